"""sdp.tensorflow's collectives, tapes and layers across 2 real processes, against numpy references."""
import importlib.util
import numpy as np
import pytest

from harness import check_ok, run_cases, run_workers

pytest.importorskip("tensorflow")

pytestmark = pytest.mark.tf
BUCKETS = [(64 << 20, 1), (2048, 4), (0, 6)]


@pytest.fixture(scope="module")
def runs():
    """One 2-rank launch for the tests below that check results against numpy: the collectives
    eagerly and in a tf.function, the tapes, the gradient buckets per fusion threshold (each case
    sets its own), then the held gradients (they fill the result pool); one launch instead of 7."""
    return run_cases(2, [("collectives eager", "workers_tf_api:collectives", ["eager"]),
                         ("collectives graph", "workers_tf_api:collectives", ["graph"]),
                         ("tapes", "workers_tf_api:tapes", [2]),
                         *((f"buckets {t}", "workers_tf_api:buckets", [t, 2]) for t, _ in BUCKETS),
                         ("held_gradients", "workers_tf_api:held_gradients", [200])], timeout=300)


def _data(r, shape=(2, 3), dtype=np.float32):
    return (np.arange(np.prod(shape)).reshape(shape) + 10 * r + 1).astype(dtype)


def _check_collectives(values):
    x = [_data(r) for r in range(2)]
    s = x[0] + x[1]
    gat = np.concatenate([_data(r, shape=(r + 1, 2)) for r in range(2)])
    a2a = [_data(r, shape=(3, 2)) for r in range(2)]
    rs = _data(0, shape=(5, 2)) + _data(1, shape=(5, 2))
    sparse = np.zeros((4, 3), np.float32)
    sparse[0], sparse[2] = _data(0, (1, 3))[0] / 2, _data(1, (1, 3))[0] / 2
    for r, v in enumerate(values):
        close = lambda key, want, **kw: np.testing.assert_allclose(np.asarray(v[key]), want, err_msg=key, **kw)  # noqa
        close("avg", s / 2)
        for key in ("smddp_positional", "horovod_average_false", "sum_kw"):
            close(key, s)
        close("min", x[0])
        close("max", x[1])
        close("product", x[0] * x[1])
        close("int_sum", _data(0, dtype=np.int32) + _data(1, dtype=np.int32))
        assert v["int_dtype"] == "int32" and v["fp16_dtype"] == "float32"
        close("fp16", s / 2, rtol=1e-3)
        close("scaled", 3 * s)
        close("oob", s / 2)
        close("grouped", [s, 2 * s])
        close("allgather", gat)
        close("grouped_allgather", [gat, 2 * gat])
        close("broadcast", x[1])
        out, rsplits = v["alltoall"]
        want = [a2a[0][:1], a2a[1][:2]] if r == 0 else [a2a[0][1:], a2a[1][2:]]
        np.testing.assert_allclose(out, np.concatenate(want))
        assert rsplits == ([1, 2] if r == 0 else [2, 1])
        close("reducescatter", rs[:3] if r == 0 else rs[3:])
        close("reducescatter_avg", (rs[:3] if r == 0 else rs[3:]) / 2)
        close("sparse", sparse)
        close("overlap", x[r])
        assert [v["rank_op"], v["size_op"], v["local_rank_op"], v["local_size_op"]] == [r, 2, r, 2]


def test_collectives_eager_match_numpy(runs):
    values = check_ok(runs["collectives eager"])
    _check_collectives(values)
    for r, v in enumerate(values):
        np.testing.assert_allclose(v["broadcast_"][0], _data(1))
        np.testing.assert_allclose(v["broadcast_"][1], _data(1, shape=(2,)))
        np.testing.assert_allclose(v["broadcast_"][2], _data(1))
        assert v["broadcast_object"] == {"rank": 1, "list": [1, 1, 1]}
        assert v["broadcast_object_fn"] == ["from", 0]
        assert v["allgather_object"] == [{"r": 0}, {"r": 1}]
        assert v["built"] == [False, False, 0, importlib.util.find_spec("pycuda") is not None, True]
        assert v["ids"] == [r, 2, r, 2, 0, 1]
        assert v["errors"] == {
            "device_dense": "NotImplementedError", "tape_device_sparse": "NotImplementedError",
            "opt_device_dense": "NotImplementedError", "op_and_average": "ValueError",
            "adasum": "no error", "join": "no error", "init_twice": "no error",
            "bad_param_index": "ValueError", "bucket_cap": "ValueError", "not_an_optimizer": "ValueError",
            "global_vars_eager": "RuntimeError", "sync_bn_fused": "ValueError", "predivide_sum": "ValueError",
            "process_set": "ValueError", "xla": "XlaNotSupportedError", "string_allreduce": "ValueError",
            "string_allgather": "ValueError", "complex_reducescatter": "ValueError", "bool_average": "ValueError"}


def test_collectives_in_tf_function_match_numpy(runs):
    _check_collectives(check_ok(runs["collectives graph"]))


@pytest.mark.parametrize("threshold,buckets", BUCKETS)
def test_gradient_buckets_are_submitted_one_by_one_and_match_numpy(threshold, buckets, runs):
    # one submit op per bucket; a single bucket is submitted by the step's blocking op itself
    # variables' bytes, last first (the order buckets are formed in): 48, 16, 2244, 4000, 60, 28
    values = check_ok(runs[f"buckets {threshold}"])
    shapes = [[7], [3, 5], [1000], [33, 17], [4], [2, 2, 3]]
    want = [(np.arange(np.prod(s), dtype=np.float32).reshape(s) + 1) * 1.5 for s in shapes]  # mean of 1x, 2x
    for v in values:
        assert v["submits"] == (buckets if buckets > 1 else 0)
        for mode in ("graph", "eager"):
            for got, w in zip(v[mode], want):
                np.testing.assert_allclose(got, w, rtol=1e-6, err_msg=mode)


def test_gradients_held_across_steps_keep_their_values(runs):
    # 200 steps x 1 MB: the shared-memory result pool (128 MB) fills and results move to the heap
    assert check_ok(runs["held_gradients"]) == [[], []]


def test_failures_inside_a_tf_function_step_name_ranks_and_values():
    # a mismatch: every rank's step raises Horovod's FailedPreconditionError (sdp's compiled
    # SdpCheck op) carrying sdp's message
    for rank, (etype, msg, seconds) in enumerate(check_ok(run_workers(2, "workers_tf_api:failures",
                                                                      ["mismatch"], timeout=120))):
        assert etype == "FailedPreconditionError", (rank, etype)
        assert ("allreduce of 'sdp.DistributedGradientTape.grad_0': shape mismatch, "
                "rank 0 has [2, 3], rank 1 has [3, 3]") in msg, (rank, msg[-800:])
        assert seconds < 5, (rank, seconds)
    # a lost peer: the two survivors' steps raise UnknownError carrying PeerLostError within 10 s
    results = run_workers(3, "workers_tf_api:failures", ["peer_lost"], timeout=120)
    assert results[2].returncode == -9
    for r in (0, 1):
        assert results[r].ok, results[r].stderr[-2000:]
        etype, msg, seconds = results[r].value
        assert etype == "UnknownError" and "PeerLostError: lost connection to rank 2" in msg, (r, msg[-800:])
        assert seconds < 10, (r, seconds)


def test_aligned_results_reach_tensorflow_without_a_copy():
    import tensorflow as tf

    from sdp.engine.fusion import aligned_empty
    from sdp.tensorflow.ops import as_output
    a = aligned_empty(np.float32, 1000)
    a[:] = np.arange(1000)
    t = as_output(a.reshape(10, 100))
    assert isinstance(t, tf.Tensor) and t.shape == (10, 100) and np.shares_memory(np.asarray(t), a)
    assert float(tf.reduce_sum(t)) == sum(range(1000))
    misaligned = a[1:]  # TensorFlow aborts the process on a tensor 4 bytes past a 64-byte boundary
    assert as_output(misaligned) is misaligned
    strided = a[::2]
    assert as_output(strided) is strided
    empty = a[:0]
    assert as_output(empty) is empty


def _sync_bn_reference():
    import tensorflow as tf
    data = [_data(r, shape=(3, 2)) * (1 + r) for r in range(2)]
    xs = [tf.constant(d) for d in data]
    with tf.GradientTape() as tape:
        tape.watch(xs)
        allx = tf.concat(xs, 0)
        mean, var = tf.nn.moments(allx, axes=[0])
        ys = [(x - mean) * tf.math.rsqrt(var + 1e-3) for x in xs]
        loss = sum(tf.reduce_sum(y * tf.constant([[1.0, 2.0]]) * (1 + r) + y ** 2) for r, y in enumerate(ys))
    grads = tape.gradient(loss, xs)
    return [y.numpy() for y in ys], mean.numpy(), [g.numpy() for g in grads]


def test_tapes_and_sync_batch_norm_match_numpy(runs):
    values = check_ok(runs["tapes"])
    x = [_data(r, shape=(2, 3)) for r in range(2)]
    w = np.ones([3, 2], np.float32)
    gw = np.mean([2 * xr.T @ (xr @ w) for xr in x], axis=0)
    ge = np.zeros((4, 3), np.float32)
    ge[0], ge[1], ge[3] = 0.5, 1.0, 1.5
    ys, mean, gxs = _sync_bn_reference()
    for r, v in enumerate(values):
        for label in ("plain", "dense", "predivide", "fp16"):
            rtol = 2e-3 if label == "fp16" else 1e-5
            np.testing.assert_allclose(v[label]["gw"], gw, rtol=rtol, err_msg=label)
            np.testing.assert_allclose(v[label]["ge"], ge, rtol=rtol, err_msg=label)
        assert [v[k]["sparse"] for k in ("plain", "fp16", "dense", "predivide")] == [True, True, False, False]
        np.testing.assert_allclose(v["partial"]["local"], [[(1.0 + r) / 2]])
        np.testing.assert_allclose(v["partial"]["shared"], [[1.5]])
        np.testing.assert_allclose(v["sync_bn"]["y"], ys[r], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(v["sync_bn"]["moving_mean"], mean * 0.5, rtol=1e-5)
        np.testing.assert_allclose(v["sync_bn"]["gx"], gxs[r], rtol=1e-3, atol=1e-4)


def test_the_eager_fast_path_matches_the_layers():
    """``ops.eager_allreduce`` (issue 30: 1 KB eager 13.9 -> ~6.7 us) gives what the layers give,
    and leaves them what it must: bool, a Variable, a recording tape, a tf.function."""
    for fast, equal, errors in check_ok(run_workers(2, "workers_tf_api:eager_fast_path", [], timeout=180)):
        assert all(equal.values()), equal
        assert fast == {"avg": [True], "sum": [True], "int_sum": [True], "f16_min": [True], "scaled": [True],
                        "bool_max": [False], "variable": [], "tape": [False], "graph": []}, fast
        assert errors == ["TensorMismatchError True: shape mismatch"] * 2, errors
