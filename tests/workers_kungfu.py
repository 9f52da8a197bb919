"""Workers for tests/test_kungfu_bridge.py: run inside real rank processes (see harness.py)."""
import time

import numpy as np


def _np(t):
    return np.asarray(t).tolist()


def ops_check():
    """Every kungfu.tensorflow.ops operator, eagerly, in tf.function and in a v1 session."""
    import tensorflow as tf

    import sdp_kungfu_bridge.python as kf
    from sdp_kungfu_bridge import _model_store
    from sdp_kungfu_bridge.tensorflow import initializer, ops

    r, n = kf.current_rank(), kf.current_cluster_size()
    x = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * r)
    out = {"rank": r, "size": n, "local_rank": kf.current_local_rank(),
           "local_size": kf.current_local_size(), "detached": kf.detached(), "uid": str(kf.uid())}
    for op in ("sum", "min", "max", "prod"):
        out[f"all_reduce_{op}"] = _np(ops.all_reduce(x, op=op))
    g = ops.group_all_reduce([x, None, tf.constant(r + 1, tf.int32)])
    out["group"] = [_np(g[0]), g[1], _np(g[2])]
    out["all_gather"] = _np(ops.all_gather(x))
    out["broadcast"] = _np(ops.broadcast(x))
    out["consensus_diff"] = bool(ops.consensus(x))
    out["consensus_same"] = bool(ops.consensus(tf.ones([4])))
    out["peer_info"] = [int(t) for t in ops.peer_info()]
    assert ops.barrier() is None
    kf.run_barrier()
    out["int_max"] = kf.all_reduce_int_max(7 * r + 1)
    out["other_ranks"] = kf._get_other_ranks()

    @tf.function
    def traced(t):
        ops.barrier()
        return ops.all_reduce(t), ops.all_gather(t), ops.broadcast(t), ops.peer_info()[1]

    out["traced"] = [[_np(a) for a in traced(x)] for _ in range(2)]

    c = ops.counter()
    c2 = ops.counter(init=5, incr=2)

    @tf.function
    def count():
        return ops.counter(), ops.counter(init=5, incr=2)

    out["counter_eager"] = [int(c), int(c2)]
    out["counter_traced"] = [[int(v) for v in count()] for _ in range(3)]
    out["schedule"] = [int(ops.step_based_schedule("1:2,3:2", s)) for s in range(6)]

    # model store: save, a barrier, then pull the other peer's values
    peer = (r + 1) % n
    ops.save_variable(x, name="x")
    ops.save_variable(x * 2, version=tf.constant(3, tf.int64), name="y")
    ops.save_variable(x * 3, version=tf.constant(4, tf.int64), name="y")
    kf.run_barrier()
    out["request"] = _np(ops.request_variable(peer, name="x", shape=[2, 3], dtype=tf.float32))
    out["request_v3"] = _np(ops.request_variable(peer, version=3, name="y", shape=[2, 3], dtype=tf.float32))
    out["request_latest"] = _np(ops.request_variable(peer, name="y", shape=[2, 3], dtype=tf.float32))
    tmpl = tf.Variable(tf.zeros([2, 3]), name="tmpl")
    ops.save_variable(tmpl + 10 * r, name=tmpl.name)
    kf.run_barrier()
    out["request_template"] = _np(ops.request_variable_with_template(peer, tmpl))
    try:
        ops.request_variable(peer, name="nope", shape=[1], dtype=tf.float32)
        out["request_missing"] = None
    except Exception as e:  # noqa: BLE001
        out["request_missing"] = type(e).__name__
    out["store_error_is"] = issubclass(_model_store.StoreError, Exception)

    # noise scale: two updates of one estimator
    gs = tf.constant([1.0, 2.0, 3.0])
    gb = tf.constant([0.5, 1.0, 1.0])

    @tf.function
    def gns(a, b):
        return ops.global_noise_scale(8, 32, a, b, alpha=0.5)

    out["gns"] = [float(gns(gs, gb)), float(gns(gs * 2, gb))]

    # fuse/defuse
    f = ops.fuse([x, tf.ones([3])])
    back = ops.defuse(f, [[2, 3], [3]])
    out["defuse_ok"] = bool(np.array_equal(back[0].numpy(), x.numpy()))

    # broadcast_variables eagerly and in tf.function
    v = tf.Variable(tf.fill([3], float(r + 1)))
    initializer.broadcast_variables([v])
    out["bcast_eager"] = _np(v.numpy())
    w = tf.Variable(tf.fill([2], float(r + 5)))

    @tf.function
    def bcast():
        initializer.broadcast_variables([w])

    bcast()
    out["bcast_traced"] = _np(w.numpy())

    # tf.compat.v1 graph + session: BroadcastGlobalVariablesOp, the hook, graph-mode ops
    with tf.Graph().as_default():
        gv = tf.compat.v1.Variable(np.full([2], r + 1.0, np.float32))
        gv2 = tf.compat.v1.Variable(np.full([2], r + 2.0, np.float32))
        red = ops.all_reduce(tf.constant([1.0, r]))
        bar = ops.barrier()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(initializer.BroadcastGlobalVariablesOp())
            sess.run(bar)
            out["session"] = [_np(sess.run(gv)), _np(sess.run(red))]
        sess.close()
        hook = initializer.BroadcastGlobalVariablesHook()
        with tf.compat.v1.train.MonitoredSession(hooks=[hook]) as sess:
            out["hook"] = _np(sess.run(gv2))
    out["session_optimizers"] = _session_optimizers(r)
    return out


def _session_optimizers(r):
    """KungFu's TF1 Session recipe: minimize with a wrapped tf.compat.v1 optimizer after
    BroadcastGlobalVariablesOp; returns every worker's weights after 3 steps per algorithm."""
    import tensorflow as tf

    from sdp import api
    from sdp_kungfu_bridge.tensorflow import initializer, optimizers

    out = {}
    for algo in ("SynchronousSGDOptimizer", "SynchronousAveragingOptimizer", "PairAveragingOptimizer"):
        with tf.Graph().as_default():
            w = tf.compat.v1.Variable(np.full([3], r + 1.0, np.float32))
            x = tf.constant(np.arange(3, dtype=np.float32) * (r + 1))
            loss = tf.reduce_sum(tf.square(w * x - 1.0))
            opt = getattr(optimizers, algo)(tf.compat.v1.train.GradientDescentOptimizer(0.01))
            train_op = opt.minimize(loss)
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                sess.run(initializer.BroadcastGlobalVariablesOp())
                start = sess.run(w)
                for _ in range(3):
                    sess.run(train_op)
                end = sess.run(w)
        out[algo] = {"start": _np(start), "end": api.allgather_object(_np(end), name=f"session.{algo}")}
    return out


def _linear_model(seed, keras):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer=keras.initializers.RandomNormal(seed=seed),
                                                                     bias_initializer="zeros")])
    return model


def optimizer_check(algo, v1=False, steps=3, lr=0.1):
    """One linear model per rank (different initial weights), trained ``steps`` steps on rank-
    specific data with the KungFu optimizer ``algo``; returns weights and local gradients."""
    import keras
    import tensorflow as tf

    import sdp_kungfu_bridge.python as kf
    from sdp_kungfu_bridge.tensorflow import optimizers

    r = kf.current_rank()
    model = _linear_model(100 + r, keras)
    xs = np.random.default_rng(r).normal(size=(steps, 4, 3)).astype(np.float32)
    ys = np.random.default_rng(10 + r).normal(size=(steps, 4, 2)).astype(np.float32)
    base = tf.compat.v1.train.GradientDescentOptimizer(lr) if v1 else keras.optimizers.SGD(lr)
    opt = getattr(optimizers, algo)(base)
    if not v1:
        assert isinstance(opt, keras.optimizers.SGD), type(opt)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return grads

    hist = [[_np(v.numpy()) for v in model.trainable_variables]]
    grads_hist = []
    for i in range(steps):
        g = step(tf.constant(xs[i]), tf.constant(ys[i]))
        grads_hist.append([_np(t.numpy()) for t in g])
        hist.append([_np(v.numpy()) for v in model.trainable_variables])
    return {"weights": hist, "grads": grads_hist, "x": _np(xs), "y": _np(ys),
            "n_opt_vars": len(opt.variables())}


def pair_avg_check(slow_rank, sleep_s, steps):
    """PairAveragingOptimizer with one slow rank: the others must not wait for it."""
    import keras
    import tensorflow as tf

    import sdp_kungfu_bridge.python as kf
    from sdp import api
    from sdp_kungfu_bridge.tensorflow import optimizers

    r = kf.current_rank()
    model = _linear_model(200 + r, keras)
    opt = optimizers.PairAveragingOptimizer(keras.optimizers.SGD(0.001))
    x = tf.constant(np.random.default_rng(r).normal(size=(4, 3)).astype(np.float32))
    y = tf.constant(np.zeros((4, 2), np.float32))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    def flat():
        return np.concatenate([v.numpy().ravel() for v in model.trainable_variables])

    initial = api.allgather_object(flat().tolist(), name="pa.initial")
    step()  # first step: saves the model and waits for every peer (the store is ready)
    t0 = time.monotonic()
    for _ in range(steps):
        if r == slow_rank:
            time.sleep(sleep_s)
        step()
    elapsed = time.monotonic() - t0
    kf.run_barrier()
    final = api.allgather_object(flat().tolist(), name="pa.final")
    return {"elapsed": elapsed, "initial": initial, "final": final,
            "pulls": opt.kungfu_algorithm.pulls}


def keras_check(steps=6):
    """model.fit with a wrapped optimizer and BroadcastGlobalVariablesCallback; noise scale."""
    import keras
    import tensorflow as tf

    import sdp_kungfu_bridge.python as kf
    from sdp import api
    from sdp_kungfu_bridge.tensorflow import initializer, optimizers

    r = kf.current_rank()
    keras.utils.set_random_seed(r)  # different initial models until the callback broadcasts
    out = {}
    for kind in ("SynchronousSGDOptimizer", "SynchronousAveragingOptimizer", "MonitorGradientNoiseScaleOptimizer"):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"),
                                  keras.layers.Dense(2)])
        args = (8,) if kind.startswith("Monitor") else ()
        kw = {"verbose": False} if kind.startswith("Monitor") else {"with_keras": True}
        opt = getattr(optimizers, kind)(keras.optimizers.Adam(0.01), *args, **kw)
        model.compile(optimizer=opt, loss="mse")
        xs = np.random.default_rng(50 + r).normal(size=(8 * steps, 3)).astype(np.float32)
        ys = np.random.default_rng(60 + r).normal(size=(8 * steps, 2)).astype(np.float32)
        model.fit(xs, ys, batch_size=8, epochs=1, shuffle=False, verbose=0,
                  callbacks=[initializer.BroadcastGlobalVariablesCallback()])
        flat = np.concatenate([v.numpy().ravel() for v in model.trainable_variables]).tolist()
        everyone = api.allgather_object(flat, name=f"keras.{kind}")
        out[kind] = {"same": all(np.allclose(everyone[0], e, atol=0, rtol=0) for e in everyone),
                     "iterations": int(opt.iterations.numpy())}
        if kind.startswith("Monitor"):
            out[kind]["noise_scale"] = float(opt.kungfu_algorithm.noise_scale)
    return out


def elastic_errors():
    """resize without sdprun -w, and with disagreeing sizes: clear errors, nothing changes."""
    import sdp_kungfu_bridge.python as kf

    out = {}
    out["same_size"] = list(kf.resize(kf.current_cluster_size()))
    for label, fn in (("no_server", lambda: kf.resize(kf.current_cluster_size() + 1)),
                      ("disagree", lambda: kf.resize(2 + kf.current_rank())),
                      ("from_url", lambda: kf.resize()),
                      ("propose", lambda: kf.propose_new_size(3))):
        try:
            fn()
            out[label] = None
        except Exception as e:  # noqa: BLE001
            out[label] = [type(e).__name__, str(e)]
    kf.run_barrier()
    out["size_after"] = kf.current_cluster_size()
    out["detached"] = kf.detached()
    return out


def optimizers_all():
    """optimizer_check for S-SGD (Keras and v1 optimizers) and SMA, in one process."""
    return {"ssgd": optimizer_check("SynchronousSGDOptimizer"),
            "ssgd_v1": optimizer_check("SynchronousSGDOptimizer", v1=True),
            "sma": optimizer_check("SynchronousAveragingOptimizer"),
            "sma_v1": optimizer_check("SynchronousAveragingOptimizer", v1=True)}


def finalize_check():
    """finalize() leaves: operations raise, cluster info keeps the last values; init() rejoins."""
    import sdp_kungfu_bridge.python as kf
    from sdp.common.errors import NotInitializedError

    r = kf.current_rank()
    kf.finalize()
    kf.finalize()  # idempotent
    out = {"rank_after": kf.current_rank(), "size_after": kf.current_cluster_size()}
    try:
        kf.run_barrier()
        out["barrier"] = None
    except NotInitializedError as e:
        out["barrier"] = str(e)
    kf.init()
    out["max"] = kf.all_reduce_int_max(r)
    return out
