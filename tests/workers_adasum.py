"""Worker functions for tests/test_adasum_mp.py: Adasum allreduces of seeded inputs (``inputs``,
which the test regenerates for its own reference) through every entry of ``sdp.api``."""
import base64

import numpy as np

import sdp

DTYPES = ("float16", "float32", "float64")


def inputs(case: str, rank: int, dtype: str) -> list:
    """Rank ``rank``'s tensors of ``case`` in ``dtype`` (the same function on every side)."""
    rng = np.random.default_rng([DTYPES.index(dtype), rank, sum(map(ord, case))])

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    if case == "single":  # one tensor, sdp.allreduce
        return [normal(5, 7)]
    if case == "async":  # two tensors, allreduce_async (the engine fuses them: one bucket, two tensors)
        return [normal(300), normal(4, 4, scale=100.0)]
    if case == "grouped":  # very different norms in one flattened group: per tensor, not per buffer
        return [normal(33, scale=1e-3), normal(10, 10, scale=1e3), normal(7), normal(0), normal(1, scale=5.0)]
    if case == "large":  # fused by the engine (arrays over 64 KB), more than one 1 MB segment each
        return [normal(300_000), normal(70_000, scale=7.0)]
    if case == "device":  # device arrays (the numpy backend's stand-ins): one, then a group of two
        return [normal(5, 7), normal(33, scale=1e-3), normal(10, 10, scale=1e3)]
    if case == "zeros":  # zero on rank 0, zero everywhere, opposite on the ranks of a pair (sums to 0)
        y = np.random.default_rng(7).standard_normal(20).astype(dtype)
        return [normal(50) * (rank != 0), np.zeros(8, dtype), y if rank % 2 == 0 else -y]
    raise ValueError(case)


def _encode(arrays) -> list:
    return [[a.dtype.str, list(a.shape), base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()]
            for a in arrays]


def run(cases) -> dict:
    """``{case: {dtype: encoded results}}`` for ``cases``, every dtype; plus how many allreduces the
    fast lane, inline and the leaders' link ran (none may have run an Adasum)."""
    r, out = sdp.rank(), {}
    for case in cases:
        out[case] = {}
        for dtype in DTYPES:
            xs = inputs(case, r, dtype)
            name = f"{case}.{dtype}"
            if case == "single":
                got = [sdp.allreduce(xs[0], name=name, op=sdp.Adasum)]
            elif case == "async":
                handles = [sdp.allreduce_async(x, name=f"{name}.{i}", op=sdp.Adasum) for i, x in enumerate(xs)]
                got = [h.wait() for h in handles]
            elif case == "device":  # (SDP_DEVICE_BACKEND=numpy: host memory behind __cuda_array_interface__)
                from workers_device import make, to_numpy
                got = [to_numpy("fake", sdp.allreduce(make("fake", xs[0]), name=name, op=sdp.Adasum), dtype)]
                got += [to_numpy("fake", g, dtype) for g in sdp.grouped_allreduce(
                    [make("fake", x) for x in xs[1:]], name=name + ".g", op=sdp.Adasum)]
            elif case in ("grouped", "large"):
                got = sdp.grouped_allreduce(xs, name=name, op=sdp.Adasum)
            else:
                handles = sdp.grouped_allreduce_async(xs, [f"{name}.{i}" for i in range(len(xs))], op=sdp.Adasum)
                got = [h.wait() for h in handles]
            assert all(g.dtype == x.dtype and g.shape == x.shape for g, x in zip(got, xs)), name
            out[case][dtype] = _encode(got)
    rt = sdp.api.runtime()
    lane = 0 if rt.lane is None else rt.lane.counts.get("fast", 0)
    out["paths"] = [lane, rt.inline_allreduces, 0 if rt.link is None else rt.link.fast]
    return out


def refused() -> list:
    """What each Adasum entry raises here (a job whose size is not a power of two): [type, text]
    per entry; then a Sum allreduce still works (nothing half-sent)."""
    x = np.ones(4, np.float32)
    got = []
    for call in (lambda: sdp.allreduce(x, name="a", op=sdp.Adasum),
                 lambda: sdp.allreduce_async(x, name="b", op=sdp.Adasum),
                 lambda: sdp.grouped_allreduce([x, x], name="c", op=sdp.Adasum),
                 lambda: sdp.api.check_adasum()):
        try:
            call()
            got.append(["no error", ""])
        except Exception as e:  # noqa: BLE001 - recorded for the test
            got.append([type(e).__name__, str(e)])
    got.append(float(sdp.allreduce(x, name="after", op=sdp.Sum)[0]))
    return got


def bad_input() -> list:
    """[type, text] of what an integer Adasum, an Adasum reducescatter and an Adasum of a process
    set (rank 0 alone; rank 1 does not call it) raise."""
    got = []
    ps = sdp.api.add_process_sets([[0]])[0]
    if sdp.rank() != 0:
        ps = 0
    for call in (lambda: sdp.allreduce(np.ones(3, np.int32), name="i", op=sdp.Adasum),
                 lambda: sdp.reducescatter(np.ones(4, np.float32), name="rs", op=sdp.Adasum),
                 lambda: sdp.allreduce(np.ones(3, np.float32), name="ps", op=sdp.Adasum, process_set=ps)):
        try:
            call()
            got.append(["no error", ""])
        except Exception as e:  # noqa: BLE001 - recorded for the test
            got.append([type(e).__name__, str(e)])
    return got


def linear_data(rank: int):
    """Rank ``rank``'s batch for the TensorFlow checks: X (8 x 3), y (8), float32."""
    rng = np.random.default_rng(100 + rank)
    return rng.standard_normal((8, 3)).astype(np.float32), rng.standard_normal(8).astype(np.float32)


W0, B0, LR = [0.5, -1.0, 2.0], 0.25, 0.1  # the linear model's start and the optimizer's learning rate


def tf_face() -> dict:
    """sdp.tensorflow with op=hvd.Adasum: allreduce eagerly (float16/32/64), grouped_allreduce in a
    tf.function, DistributedGradientTape, DistributedOptimizer of a tf.compat.v1 optimizer
    (eagerly, 1 pass per step; in a TF1 graph, 2 passes per step), and the errors Horovod gives."""
    import tensorflow as tf
    import sdp.tensorflow as hvd
    r, out = hvd.rank(), {}
    for dtype in DTYPES:
        xs = inputs("single", r, dtype) + inputs("grouped", r, dtype)[:3]
        out[f"allreduce.{dtype}"] = _encode([hvd.allreduce(tf.constant(x), op=hvd.Adasum).numpy() for x in xs[:1]])
        grouped = tf.function(lambda *ts: hvd.grouped_allreduce(list(ts), op=hvd.Adasum))
        out[f"grouped.{dtype}"] = _encode([t.numpy() for t in grouped(*[tf.constant(x) for x in xs[1:]])])
    X, y = linear_data(r)

    def loss(w, b):
        return tf.reduce_sum((tf.linalg.matvec(tf.constant(X), w) + b - y) ** 2)

    w, b = tf.Variable(W0), tf.Variable(B0)
    with tf.GradientTape() as tape:
        value = loss(w, b)
    tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum)
    out["tape"] = _encode([g.numpy() for g in tape.gradient(value, [w, b])])
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR), op=hvd.Adasum)
    for _ in range(2):
        opt.minimize(lambda: loss(w, b), var_list=[w, b])
    out["optimizer.eager"] = _encode([w.numpy(), np.asarray(b.numpy())])
    with tf.Graph().as_default():
        gw, gb = tf.Variable(W0), tf.Variable(B0)
        gopt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR), op=hvd.Adasum,
                                        backward_passes_per_step=2)
        train = gopt.minimize(loss(gw, gb), var_list=[gw, gb])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            seen = []
            for _ in range(4):
                sess.run(train)
                seen.append(sess.run([gw, gb]))
    out["optimizer.graph"] = [_encode([sw, np.asarray(sb)]) for sw, sb in seen]
    errors = {}
    for case, call in (("keras", lambda: hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), op=hvd.Adasum)),
                       ("sparse", lambda: hvd.allreduce(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0])),
                                                        op=hvd.Adasum)),
                       ("reducescatter", lambda: hvd.reducescatter(tf.ones([4]), op=hvd.Adasum)),
                       ("averaged", lambda: hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                                                     op=hvd.Adasum, backward_passes_per_step=2,
                                                                     average_aggregated_gradients=True)),
                       ("int", lambda: hvd.allreduce(tf.constant([1, 2]), op=hvd.Adasum))):
        try:
            call()
            errors[case] = ["no error", ""]
        except Exception as e:  # noqa: BLE001 - recorded for the test
            errors[case] = [type(e).__name__, str(e)]
    out["errors"] = errors
    return out
