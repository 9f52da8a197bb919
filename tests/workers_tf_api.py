"""Workers for tests/test_tf_api.py: sdp.tensorflow's collectives, tapes and layers, run inside
real rank processes.  Each returns plain lists; the test compares them with numpy references."""
import numpy as np


def _data(r, shape=(2, 3), dtype=np.float32):
    return (np.arange(np.prod(shape)).reshape(shape) + 10 * r + 1).astype(dtype)


def _errors(hvd, tf):
    """Documented errors; returns {case: exception class name}."""
    out = {}

    def expect(case, fn):
        try:
            fn()
            out[case] = "no error"
        except Exception as e:  # noqa: BLE001
            out[case] = type(e).__name__

    x = tf.constant([1.0])
    expect("device_dense", lambda: hvd.allreduce(x, device_dense="/gpu:0"))
    expect("tape_device_sparse", lambda: hvd.DistributedGradientTape(tf.GradientTape(), device_sparse="/gpu:0"))
    expect("opt_device_dense", lambda: hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                                                device_dense="/gpu:0"))
    expect("op_and_average", lambda: hvd.allreduce(x, op=hvd.Sum, average=True))
    expect("adasum", lambda: hvd.allreduce(x, op=hvd.Adasum))
    expect("join", lambda: int(hvd.join()) in (0, 1) or 1 / 0)
    expect("init_twice", hvd.init)  # Horovod's rule under sdp's own name
    expect("bad_param_index", lambda: hvd.allreduce(x, 3, 2))
    expect("bucket_cap", lambda: hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                                          bucket_cap_mb=1e-9))
    expect("not_an_optimizer", lambda: hvd.DistributedOptimizer(object()))
    expect("global_vars_eager", lambda: hvd.broadcast_global_variables(0))
    expect("sync_bn_fused", lambda: hvd.SyncBatchNormalization(fused=True))
    expect("predivide_sum", lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Sum,
                                                                gradient_predivide_factor=2.0))
    expect("process_set", lambda: hvd.allreduce(x, process_set=object()))
    expect("string_allreduce", lambda: hvd.allreduce(tf.constant(["a"])))  # raised before any op runs
    expect("string_allgather", lambda: hvd.allgather(tf.constant(["a"])))
    expect("complex_reducescatter", lambda: hvd.reducescatter(tf.constant([1 + 2j, 3j]), op=hvd.Sum))
    expect("bool_average", lambda: hvd.allreduce(tf.constant([True])))

    @tf.function(jit_compile=True)
    def xla(t):
        return hvd.allreduce(t)

    expect("xla", lambda: xla(x))
    return out


def collectives(mode):
    """Every collective once, eagerly (``mode="eager"``) or inside one tf.function (``"graph"``)."""
    import tensorflow as tf

    import sdp.tensorflow as hvd
    r, n = hvd.rank(), hvd.size()
    x = tf.constant(_data(r))
    xi = tf.constant(_data(r, dtype=np.int32))
    gat = tf.constant(_data(r, shape=(r + 1, 2)))  # first dimension differs per rank
    a2a = tf.constant(_data(r, shape=(3, 2)))
    splits = tf.constant([1, 2] if r == 0 else [2, 1], tf.int32)
    rs = tf.constant(_data(r, shape=(5, 2)))
    sparse = tf.IndexedSlices(tf.constant(_data(r, shape=(1, 3))), tf.constant([r * 2], tf.int64),
                              dense_shape=tf.constant([4, 3], tf.int64))

    def run():
        out = {
            "avg": hvd.allreduce(x),
            "smddp_positional": hvd.allreduce(x, 0, 1, hvd.Compression.none, hvd.ReduceOp.SUM),
            "horovod_average_false": hvd.allreduce(x, False),
            "sum_kw": hvd.allreduce(x, average=False),
            "min": hvd.allreduce(x, op=hvd.Min),
            "max": hvd.allreduce(x, op=hvd.Max),
            "product": hvd.allreduce(x, op=hvd.Product),
            "int_sum": hvd.allreduce(xi, op=hvd.Sum),
            "fp16": hvd.allreduce(x, compression=hvd.Compression.fp16),
            "scaled": hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5 * 3),
            "oob": hvd.oob_allreduce(x),
            "grouped": hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum),
            "allgather": hvd.allgather(gat),
            "grouped_allgather": hvd.grouped_allgather([gat, 2 * gat]),
            "broadcast": hvd.broadcast(x, 1),
            "alltoall": hvd.alltoall(a2a, splits=splits),
            "reducescatter": hvd.reducescatter(rs, op=hvd.Sum),
            "reducescatter_avg": hvd.reducescatter(rs),
            "sparse": hvd.allreduce(sparse),
            "overlap": hvd.overlap(x),
            "rank_op": hvd.rank_op(), "size_op": hvd.size_op(),
            "local_rank_op": hvd.local_rank_op(), "local_size_op": hvd.local_size_op(),
        }
        return out

    if mode == "graph":
        run = tf.function(run)
    out = run()

    def lists(v):
        if isinstance(v, tf.IndexedSlices):
            return tf.convert_to_tensor(v).numpy().tolist()
        if isinstance(v, (list, tuple)):
            return [lists(e) for e in v]
        return np.asarray(v).tolist()

    res = {k: lists(v) for k, v in out.items()}
    res["fp16_dtype"] = out["fp16"].dtype.name
    res["int_dtype"] = out["int_sum"].dtype.name
    if mode == "eager":
        v = tf.Variable(_data(r))
        w = tf.Variable(_data(r, shape=(2,)))
        new = hvd.broadcast_([v, w], root_rank=1)
        res["broadcast_"] = [v.numpy().tolist(), w.numpy().tolist(), new[0].numpy().tolist()]
        res["broadcast_object"] = hvd.broadcast_object({"rank": r, "list": [r] * 3}, root_rank=1)
        res["broadcast_object_fn"] = hvd.broadcast_object_fn(root_rank=0)(("from", r))
        res["allgather_object"] = hvd.allgather_object({"r": r})
        res["errors"] = _errors(hvd, tf)
        res["built"] = [hvd.mpi_built(), hvd.gloo_built(), hvd.nccl_built(), hvd.cuda_built(), hvd.is_homogeneous()]
        res["ids"] = [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
                      hvd.cross_size()]
    return res


def tapes(steps):
    """DistributedGradientTape (fp16, sparse embedding, predivide), PartialDistributedGradientTape
    and SyncBatchNormalization, compared by the test with numpy references."""
    import keras
    import tensorflow as tf

    import sdp.tensorflow as hvd
    r = hvd.rank()
    out = {}
    w = tf.Variable(np.ones([3, 2], np.float32) * (r + 1))
    x = tf.constant(_data(r, shape=(2, 3)))
    emb = tf.Variable(np.arange(12, dtype=np.float32).reshape(4, 3))
    ids = tf.constant([r, 3])

    @tf.function
    def step(compression, sparse_as_dense, predivide):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(x, w) ** 2) + tf.reduce_sum(tf.gather(emb, ids) * (r + 1.0))
        tape = hvd.DistributedGradientTape(tape, compression=compression, sparse_as_dense=sparse_as_dense,
                                           gradient_predivide_factor=predivide)
        gw, ge = tape.gradient(loss, [w, emb])
        return gw, tf.convert_to_tensor(ge), isinstance(ge, tf.IndexedSlices)

    hvd.broadcast_variables([w], root_rank=0)
    for label, args in {"plain": (hvd.Compression.none, False, 1.0), "fp16": (hvd.Compression.fp16, False, 1.0),
                        "dense": (hvd.Compression.none, True, 1.0), "predivide": (hvd.Compression.none, True, 4.0)
                        }.items():
        for _ in range(steps):
            gw, ge, was_sparse = step(*args)
        out[label] = {"gw": gw.numpy().tolist(), "ge": ge.numpy().tolist(), "sparse": bool(was_sparse)}

    # eager tape; PartialDistributedGradientTape with one local layer
    local = keras.layers.Dense(1, use_bias=False, kernel_initializer=keras.initializers.Constant(1.0))
    shared = keras.layers.Dense(1, use_bias=False, kernel_initializer=keras.initializers.Constant(1.0))
    inp = tf.constant([[1.0 + r]])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(local(inp) + shared(inp))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
    gl, gs = tape.gradient(loss, [local.kernel, shared.kernel])
    out["partial"] = {"local": gl.numpy().tolist(), "shared": gs.numpy().tolist()}

    # SyncBatchNormalization: training output and gradient vs. a batch norm over both ranks' data
    bn = hvd.SyncBatchNormalization(momentum=0.5, epsilon=1e-3)
    data = tf.constant(_data(r, shape=(3, 2)) * (1 + r))
    with tf.GradientTape() as tape:
        tape.watch(data)
        y = bn(data, training=True)
        loss = tf.reduce_sum(y * tf.constant([[1.0, 2.0]]) * (1 + r) + y ** 2)
    gx = tape.gradient(loss, data)
    out["sync_bn"] = {"y": y.numpy().tolist(), "moving_mean": bn.moving_mean.numpy().tolist(),
                      "gx": gx.numpy().tolist()}
    return out


def buckets(threshold, steps):
    """DistributedGradientTape over variables of odd sizes (so a fused bucket needs padding to
    keep every tensor 64-byte aligned) with the fusion threshold at ``threshold`` bytes: the
    averaged gradients inside ``tf.function`` and eagerly, and how many submit ops the traced
    step holds (one per bucket when there are several: the tape hands each bucket to the engine
    on its own; none for a single bucket, which the step's one blocking op submits itself)."""
    import tensorflow as tf

    import sdp.tensorflow as hvd
    from sdp import api
    r = hvd.rank()
    api.set_fusion_threshold(threshold)
    shapes = [[7], [3, 5], [1000], [33, 17], [4], [2, 2, 3]]
    coefs = [tf.constant(np.arange(np.prod(s), dtype=np.float32).reshape(s) + 1) for s in shapes]
    variables = [tf.Variable(np.ones(s, np.float32)) for s in shapes]

    def grads():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * c * (r + 1.0)) for v, c in zip(variables, coefs)])
        return hvd.DistributedGradientTape(tape).gradient(loss, variables)

    step = tf.function(grads)
    for _ in range(steps):
        graph_grads = step()
    submits = [op.name for op in step.get_concrete_function().graph.get_operations()
               if op.type in ("PyFunc", "SdpCall") and op.name.startswith("submit")]
    return {"graph": [g.numpy().tolist() for g in graph_grads],
            "eager": [g.numpy().tolist() for g in grads()], "submits": len(submits)}


def held_gradients(steps):
    """Gradients of 1 MB kept by the caller over ``steps`` steps (more than the 128 MB result
    pool holds): each must keep its own step's value, though TensorFlow holds the engine's result
    memory itself (DLPack) and later steps reduce into new results.  Returns the bad steps."""
    import tensorflow as tf

    import sdp.tensorflow as hvd
    r = hvd.rank()
    w = tf.Variable(tf.zeros([256, 1024]))

    @tf.function
    def grad(k):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * k * (r + 1.0))
        return hvd.DistributedGradientTape(tape).gradient(loss, [w])[0]

    held = [grad(tf.constant(float(k + 1))) for k in range(steps)]
    held += [hvd.allreduce(tf.fill([256, 1024], float(k + 1) * (r + 1)), name="held.eager") for k in range(20)]
    want = [1.5 * (k + 1) for k in range(steps)] + [1.5 * (k + 1) for k in range(20)]
    return [i for i, (g, v) in enumerate(zip(held, want))
            if not (float(tf.reduce_min(g)) == v == float(tf.reduce_max(g)))]


def failures(kind):
    """What a TensorFlow user sees when a collective fails inside a training step: ``mismatch``
    (rank 0 has a [2, 3] variable, rank 1 a [3, 3] one) or ``peer_lost`` (rank 2 of 3 kills itself
    after 3 steps).  Returns ``[error type, message, seconds from the failing step's start]``."""
    import os
    import signal
    import time

    import tensorflow as tf

    import sdp.tensorflow as hvd
    r = hvd.rank()
    w = tf.Variable(tf.ones([2, 3] if kind == "mismatch" and r == 0 else [3, 3]))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w)
        return hvd.DistributedGradientTape(tape).gradient(loss, [w])[0]

    step.get_concrete_function()  # trace first: the time below is the failing step's alone
    t0 = time.monotonic()
    try:
        for k in range(1000):
            t0 = time.monotonic()
            step()
            if kind == "peer_lost" and k == 2 and r == 2:
                os.kill(os.getpid(), signal.SIGKILL)
    except Exception as e:  # noqa: BLE001 - the test inspects whatever TensorFlow raised
        return [type(e).__name__, str(e), time.monotonic() - t0]
    return ["none", "", time.monotonic() - t0]


def eager_fast_path():
    """``hvd.allreduce`` of one eager tensor through ``ops.eager_allreduce`` (counted) and the same
    calls through the layers (``grouped_allreduce`` of one tensor): the same values and dtypes, the
    same error class for a shape mismatch; a recording tape, a tf.function, bool and a Variable
    take the layers.  Returns ``(fast path hits per case, results equal, error classes)``."""
    import tensorflow as tf

    import sdp.tensorflow as hvd
    from sdp.tensorflow import ops
    r = hvd.rank()
    orig, hits = ops.eager_allreduce, []

    def counted(*a):
        out = orig(*a)
        hits.append(out is not None)
        return out

    ops.eager_allreduce = counted
    cases = {"avg": (tf.constant(_data(r)), {}), "sum": (tf.constant(_data(r)), {"op": hvd.Sum}),
             "int_sum": (tf.constant(_data(r, dtype=np.int32)), {"op": hvd.Sum}),
             "f16_min": (tf.constant(_data(r, dtype=np.float16)), {"op": hvd.Min}),
             "scaled": (tf.constant(_data(r, dtype=np.float64)), {"op": hvd.Sum, "prescale_factor": 0.5,
                                                                  "postscale_factor": 3.0}),
             "bool_max": (tf.constant([True, r == 1]), {"op": hvd.Max}),
             "variable": (tf.Variable(_data(r)), {})}
    fast, equal = {}, {}
    for case, (x, kw) in cases.items():
        del hits[:]
        got = hvd.allreduce(x, name=f"fast.{case}", **kw)
        fast[case] = hits[:]
        ref = hvd.grouped_allreduce([x], name=f"slow.{case}", **kw)[0]
        equal[case] = bool(got.dtype == ref.dtype and np.array_equal(got.numpy(), ref.numpy()))
    x = tf.constant(_data(r))
    with tf.GradientTape() as tape:
        tape.watch(x)
        del hits[:]
        y = hvd.allreduce(x, name="fast.tape")
    fast["tape"] = hits[:]
    equal["tape"] = bool(np.array_equal(tape.gradient(y, x).numpy(), np.ones((2, 3), np.float32)))
    del hits[:]
    tf.function(lambda t: hvd.allreduce(t, name="fast.graph"))(x)
    fast["graph"] = hits[:]
    errors = []
    bad = tf.constant(_data(r, shape=(2 + r,)))
    for fn in (lambda: hvd.allreduce(bad, name="fast.bad"), lambda: hvd.grouped_allreduce([bad], name="slow.bad")):
        try:
            fn()
            errors.append("no error")
        except tf.errors.OpError as e:
            errors.append(f"{type(e).__name__} {isinstance(e, tf.errors.FailedPreconditionError)}: "
                          + ("shape mismatch" if "shape mismatch" in str(e) else str(e)))
    ops.eager_allreduce = orig
    return fast, equal, errors
