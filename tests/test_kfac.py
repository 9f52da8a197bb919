"""sdp.tensorflow.kfac: Kronecker factors and preconditioned gradients against direct numpy
computations, inverse ownership, and 1 rank vs 2 real ranks (chief and split strategies)."""
import numpy as np
import pytest

from harness import check_ok, run_workers

tf = pytest.importorskip("tensorflow")
kfac = pytest.importorskip("sdp.tensorflow.kfac")

pytestmark = pytest.mark.tf


def _patches_numpy(x, kh, kw, stride, padding):
    """Explicit im2col with TensorFlow's SAME/VALID padding: (B, H_out, W_out, kh*kw*c)."""
    b, h, w, c = x.shape
    if padding == "same":
        ho, wo = -(-h // stride), -(-w // stride)
        ph, pw = max((ho - 1) * stride + kh - h, 0), max((wo - 1) * stride + kw - w, 0)
        x = np.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))
    else:
        ho, wo = (h - kh) // stride + 1, (w - kw) // stride + 1
    out = np.zeros((b, ho, wo, kh * kw * c), np.float64)
    for i in range(ho):
        for j in range(wo):
            out[:, i, j] = x[:, i * stride:i * stride + kh, j * stride:j * stride + kw, :].reshape(b, -1)
    return out


def test_dense_factors_match_numpy():
    rng = np.random.default_rng(0)
    a, g = rng.standard_normal((8, 5)), rng.standard_normal((8, 3))
    A, G = kfac.dense_factors(a, g)
    ab = np.hstack([a, np.ones((8, 1))])
    np.testing.assert_allclose(A, ab.T @ ab / 8, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(G, g.T @ g / 8, rtol=1e-5, atol=1e-6)
    A, _ = kfac.dense_factors(a, g, use_bias=False)
    np.testing.assert_allclose(A, a.T @ a / 8, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stride,padding", [(1, "valid"), (2, "same")])
def test_conv2d_factors_match_numpy(stride, padding):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 6, 2)).astype(np.float32)
    kernel = rng.standard_normal((3, 3, 2, 4)).astype(np.float32)
    p = _patches_numpy(x, 3, 3, stride, padding)
    g = rng.standard_normal(p.shape[:3] + (4,)).astype(np.float32)
    A, G = kfac.conv2d_factors(x, g, (3, 3), (stride, stride), padding)
    pb = np.concatenate([p.reshape(-1, p.shape[-1]), np.ones((p[..., 0].size, 1))], axis=1)
    np.testing.assert_allclose(A, pb.T @ pb / len(pb), rtol=1e-4, atol=1e-5)
    gf = g.reshape(-1, 4).astype(np.float64)
    np.testing.assert_allclose(G, gf.T @ gf / 2, rtol=1e-4, atol=1e-5)  # summed over positions, / B
    # the patches are laid out like the kernel: Σ_t a_t g_tᵀ is TensorFlow's own kernel gradient
    k = tf.Variable(kernel)
    with tf.GradientTape() as tape:
        s = tf.nn.conv2d(x, k, strides=stride, padding=padding.upper())
        loss = tf.reduce_sum(s * g)
    np.testing.assert_allclose(tape.gradient(loss, k).numpy().reshape(-1, 4),
                               p.reshape(-1, p.shape[-1]).T @ gf, rtol=1e-4, atol=1e-4)


def _tiny_model():
    tf.keras.utils.set_random_seed(0)
    layers = tf.keras.layers
    return tf.keras.Sequential([tf.keras.Input(shape=(5, 5, 1)),
                                layers.Conv2D(2, 3, activation="relu"), layers.Flatten(),
                                layers.LayerNormalization(), layers.Dense(3, activation="tanh"),
                                layers.Dense(2, use_bias=False)])


def _damped_inverses_numpy(A, G, damping):
    A, G = np.asarray(A, np.float64), np.asarray(G, np.float64)
    pi = np.sqrt((np.trace(A) / len(A)) / (np.trace(G) / len(G)))
    return (np.linalg.inv(A + pi * np.sqrt(damping) * np.eye(len(A))),
            np.linalg.inv(G + np.sqrt(damping) / pi * np.eye(len(G))))


def test_preconditioned_gradient_is_kronecker_inverse_product():
    model = _tiny_model()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = kfac.KfacOptimizer(model, loss_fn, learning_rate=0.1, damping=0.05, inv_update_every=1,
                             norm_constraint=None)
    assert [b.kind for b in opt.blocks] == ["conv2d", "dense", "dense"]
    rng = np.random.default_rng(2)
    x = tf.constant(rng.standard_normal((6, 5, 5, 1)).astype(np.float32))
    y = tf.constant(rng.integers(0, 2, 6))
    _, _, batch_factors = opt.batch_gradients_and_factors(x, y)
    opt.step(x, y)  # the first step's factors are the batch's own
    for (A, G), (A1, G1) in zip(opt.factors, batch_factors):
        np.testing.assert_allclose(A, A1, rtol=1e-6)
        np.testing.assert_allclose(G, G1, rtol=1e-6)
    x2 = tf.constant(rng.standard_normal((6, 5, 5, 1)).astype(np.float32))
    y2 = tf.constant(rng.integers(0, 2, 6))
    _, _, batch_factors2 = opt.batch_gradients_and_factors(x2, y2)
    opt.step(x2, y2)  # warm start: the second update is the mean of both batches (decay 1/2, not 0.95)
    for (A, G), (A1, G1), (A2, G2) in zip(opt.factors, batch_factors, batch_factors2):
        np.testing.assert_allclose(A, (A1 + A2) / 2, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(G, (G1 + G2) / 2, rtol=1e-5, atol=1e-7)
    variables = model.trainable_variables
    grads = [tf.constant(rng.standard_normal(v.shape).astype(np.float32)) for v in variables]
    pre = [p.numpy() for p in opt.preconditioned_gradients(grads)]
    pos = {id(v): k for k, v in enumerate(variables)}
    seen = set()
    for b, (A, G) in zip(opt.blocks, opt.factors):
        A_inv, G_inv = _damped_inverses_numpy(A, G, 0.05)
        ks = [pos[id(v)] for v in b.variables]
        seen.update(ks)
        m = grads[ks[0]].numpy().reshape(-1, b.n_out)
        if b.use_bias:
            m = np.vstack([m, grads[ks[1]].numpy()[None]])
        want = (np.kron(G_inv, A_inv) @ m.reshape(-1, order="F")).reshape(m.shape, order="F")
        got = pre[ks[0]].reshape(-1, b.n_out)
        if b.use_bias:
            got = np.vstack([got, pre[ks[1]][None]])
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-5)
    others = [k for k in range(len(variables)) if k not in seen]
    assert len(others) == 2  # LayerNormalization's gamma and beta keep their plain gradient
    for k in others:
        np.testing.assert_array_equal(pre[k], grads[k].numpy())
    # the norm constraint scales everything by min(1, sqrt(c / (lr² Σ gᵀ F⁻¹ g)))
    sq = sum(float(np.sum(g.numpy() * p)) for g, p in zip(grads, pre)) * 0.1 ** 2
    opt.norm_constraint = sq / 4
    clipped = opt.preconditioned_gradients(grads)
    for p, c in zip(pre, clipped):
        np.testing.assert_allclose(c.numpy(), p / 2, rtol=1e-4, atol=1e-7)


def test_sampled_fisher_g_is_the_softmax_fisher():
    # estimation_mode="gradients": g = softmax(s) - onehot(y), y ~ softmax(s), so for one input
    # repeated, E[g gᵀ] = diag(p) - p pᵀ; with the true label instead, G = (p - e_y)(p - e_y)ᵀ
    tf.keras.utils.set_random_seed(4)
    model = tf.keras.Sequential([tf.keras.Input(shape=(3,)), tf.keras.layers.Dense(4)])
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x = tf.constant(np.tile([[0.5, -1.0, 2.0]], (20000, 1)).astype(np.float32))
    y = tf.zeros(20000, tf.int64)
    p = tf.nn.softmax(model(x[:1]))[0].numpy().astype(np.float64)
    sampled = kfac.KfacOptimizer(model, loss_fn, estimation_mode="gradients")
    _, _, [(_, G)] = sampled.batch_gradients_and_factors(x, y)
    np.testing.assert_allclose(G, np.diag(p) - np.outer(p, p), atol=0.015)  # ~4 MC standard errors
    empirical = kfac.KfacOptimizer(model, loss_fn, estimation_mode="empirical")
    _, _, [(_, G)] = empirical.batch_gradients_and_factors(x, y)
    e = p - np.eye(4)[0]
    np.testing.assert_allclose(G, np.outer(e, e), rtol=1e-4, atol=1e-6)


def test_bad_arguments_raise():
    model, loss_fn = _tiny_model(), tf.keras.losses.MeanSquaredError()
    with pytest.raises(ValueError, match="strategy"):
        kfac.KfacOptimizer(model, loss_fn, strategy="ps")
    with pytest.raises(ValueError, match="cov_ema_decay"):
        kfac.KfacOptimizer(model, loss_fn, cov_ema_decay=1.0)
    with pytest.raises(ValueError, match="damping"):
        kfac.KfacOptimizer(model, loss_fn, damping=0)
    with pytest.raises(ValueError, match="estimation_mode"):
        kfac.KfacOptimizer(model, loss_fn, estimation_mode="exact")
    inputs = tf.keras.Input(shape=(3,))
    with pytest.raises(TypeError, match="Sequential"):
        kfac.KfacOptimizer(tf.keras.Model(inputs, tf.keras.layers.Dense(2)(inputs)), loss_fn)
    with pytest.raises(RuntimeError, match="step"):
        kfac.KfacOptimizer(model, loss_fn).preconditioned_gradients(model.trainable_variables)
    with pytest.raises(ValueError, match="built"):
        kfac.KfacOptimizer(tf.keras.Sequential([tf.keras.layers.Dense(2)]), loss_fn)
    seq = kfac.KfacOptimizer(tf.keras.Sequential([tf.keras.Input(shape=(4, 3)), tf.keras.layers.Dense(2)]), loss_fn)
    with pytest.raises(ValueError, match="rank-3"):
        seq.step(tf.zeros((2, 4, 3)), tf.zeros((2, 4, 2)))


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_inverse_tasks_cover_every_factor_once(size):
    # the factors (A, G of each layer) of the example's convnet (conv 5x5x1, conv 5x5x16, dense
    # 784->10) and of a deeper mix; a task is a column block of one factor's inverse
    for dims in ([26, 16, 401, 16, 785, 10], [10, 4, 300, 20, 50, 50, 7, 7, 200, 100, 33, 9]):
        tasks, owners = kfac.inverse_tasks(dims, size)
        assert len(owners) == len(tasks) and all(0 <= o < size for o in owners)
        for j, n in enumerate(dims):  # the blocks of factor j partition its columns [0, n) exactly once
            blocks = sorted((lo, hi) for i, lo, hi in tasks if i == j)
            assert blocks[0][0] == 0 and blocks[-1][1] == n and all(lo < hi for lo, hi in blocks)
            assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        costs = [n ** 3 / 3 + 2 * n * n * (hi - lo) for j, lo, hi in tasks for n in [dims[j]]]
        loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(size)]
        assert min(loads) > 0  # nobody idles
        assert max(loads) - min(loads) <= max(costs)  # greedy balance (largest first)
    # the dominant 785 x 785 factor is split over the ranks, so the busiest rank does less than all
    tasks, owners = kfac.inverse_tasks([26, 16, 401, 16, 785, 10], size)
    assert sum(1 for j, _, _ in tasks if j == 4) == size
    with pytest.raises(ValueError, match="size"):
        kfac.inverse_tasks([4], 0)
    with pytest.raises(ValueError, match="size"):
        kfac.assign_inverse_owners([1.0], 0)


def test_inverse_column_blocks_make_the_damped_inverse():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((50, 30))
    m = x.T @ x / 50
    chol = kfac.damped_cholesky(m, 0.1)
    blocks = [kfac.inverse_columns(chol, lo, hi) for lo, hi in [(0, 11), (11, 20), (20, 30)]]
    np.testing.assert_allclose(np.concatenate(blocks, axis=1), np.linalg.inv(m + 0.1 * np.eye(30)),
                               rtol=1e-4, atol=1e-6)


def test_one_rank_equals_two_ranks_on_the_concatenated_batch():
    steps = 5
    one = check_ok(run_workers(1, "workers_kfac:train", [steps, ["chief"]], timeout=240))[0]["chief"]
    two = check_ok(run_workers(2, "workers_kfac:train", [steps, ["chief", "split"]], timeout=240))
    w1 = np.asarray(one["weights"])
    for strategy in ("chief", "split"):
        w_r0, w_r1 = (np.asarray(v[strategy]["weights"]) for v in two)
        np.testing.assert_array_equal(w_r0, w_r1, err_msg=f"{strategy}: ranks disagree")
        np.testing.assert_allclose(w_r0, w1, rtol=1e-4, atol=1e-5, err_msg=strategy)
        assert np.abs(w_r0 - np.asarray(_initial_weights())).max() > 1e-3  # it trained
    assert two[0]["chief"]["owners"] == [0] * 6  # A and G of 3 layers, one task each
    assert len(two[0]["split"]["owners"]) == 7  # the 28 x 28 A of the Dense(4) in 2 column blocks
    assert sorted(set(two[0]["split"]["owners"])) == [0, 1]
    # chief: only rank 0 inverts; split: both ranks own a layer and invert
    assert two[0]["chief"]["timings"]["inverse"] > 0 and two[1]["chief"]["timings"]["inverse"] == 0
    assert all(v["split"]["timings"]["inverse"] > 0 for v in two)


def _initial_weights():
    import workers_kfac
    model = workers_kfac._model(tf)
    return np.concatenate([v.numpy().ravel() for v in model.trainable_variables])


def test_kfac_mnist_example_two_ranks_agree_and_learn():
    """A few steps of examples/kfac_mnist.py through sdprun (the full run is the README's command)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "examples"))
    from mnist_data import find_mnist_dir
    mnist = find_mnist_dir()
    if mnist is None:
        pytest.skip("MNIST not found: set SDP_MNIST_DIR or provide ../shared/data/mnist")
    p = subprocess.run([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", sys.executable, "examples/kfac_mnist.py",
                        "--data-dir", str(mnist), "--strategy", "split", "--steps", "8", "--eval-every", "4",
                        "--batch-size", "128"],
                       cwd=root, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), capture_output=True, text=True,
                       timeout=300)
    out = p.stdout
    assert p.returncode == 0, out[-3000:] + p.stderr[-3000:]
    assert len(re.findall(r"\[0\]<stdout>:step \d+: loss [0-9.]+, test accuracy", out)) == 2, out[-2000:]
    acc = float(re.search(r"\[0\]<stdout>:test accuracy: ([0-9.]+)", out).group(1))
    assert acc >= 0.5, out[-2000:]  # chance is 0.1
    sums = re.findall(r"\[(\d)\]<stdout>:weights checksum: ([0-9a-f]+)", out)
    assert len(sums) == 2 and sums[0][1] == sums[1][1], sums
    inverse = {int(r): float(v) for r, v in re.findall(r"\[(\d)\]<stdout>:time per step \(s\):.*inverse ([0-9.]+)", out)}
    assert sorted(inverse) == [0, 1] and all(v > 0 for v in inverse.values()), inverse  # split: both ranks own layers
