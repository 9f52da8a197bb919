"""Workers for tests/test_tf_fidelity.py (issue 31): Horovod's behaviour where a script notices it,
run inside real rank processes (gradients of every collective, TensorFlow's error classes)."""
import numpy as np


def upstream(shape, r):
    """The gradient arriving at a collective's output on rank ``r`` (differs per rank)."""
    return ((np.arange(int(np.prod(shape))).reshape(shape) + 1) * 0.5 * (r + 1)).astype(np.float32)


_SETS = {}


def _process_set(hvd, ranks):
    """The process set of ``ranks``, added on first use: a set is registered once per job, and
    several cases run in one launch (tests/harness.py run_cases)."""
    if tuple(ranks) not in _SETS:
        _SETS[tuple(ranks)] = hvd.add_process_set(list(ranks))
    return _SETS[tuple(ranks)]


def _cases(hvd, tf, r, ps):
    """(case, input, output builder) for every differentiable collective; inputs as float32."""
    n = len(ps.ranks) if ps is not None else hvd.size()
    kw = {} if ps is None else {"process_set": ps}
    gat = np.full((r + 1, 2), r + 1.0, np.float32)  # first dimension differs per rank
    a2a = np.arange(6, dtype=np.float32).reshape(3, 2) + 10 * r
    splits = [1, 2] if r == 0 else [2, 1]
    rs = np.arange(10, dtype=np.float32).reshape(5, 2) + r
    cases = [
        ("allgather", gat, lambda x: hvd.allgather(x, **kw)),
        ("grouped_allgather", gat, lambda x: hvd.grouped_allgather([x, 2 * x], **kw)[1]),
        ("broadcast0", rs, lambda x: hvd.broadcast(x, (ps.ranks if ps else [0])[0], **kw)),
        ("broadcast_last", rs, lambda x: hvd.broadcast(x, (ps.ranks if ps else list(range(n)))[-1], **kw)),
        ("reducescatter_sum", rs, lambda x: hvd.reducescatter(x, op=hvd.Sum, **kw)),
        ("reducescatter_avg", rs, lambda x: hvd.reducescatter(x, op=hvd.Average, **kw)),
    ]
    if n == 2:
        cases.append(("alltoall", a2a, lambda x: hvd.alltoall(x, splits=splits, **kw)[0]))
    return cases


def gradients(mode, with_set=False):
    """Gradients of each collective with an upstream gradient :func:`upstream` of its output's
    shape, ``mode``: "eager" (GradientTape), "function" (tape inside ``tf.function``) or "v1"
    (``tf.gradients`` in a ``tf.compat.v1`` graph, run by a Session).  ``with_set``: on a
    process set (the global one, then a set of this rank alone).  Returns {case: gradient as lists}."""
    import tensorflow as tf

    import sdp.compat_horovod.tensorflow as hvd  # horovod.tensorflow under --compat horovod
    r = hvd.rank()
    sets = [None]
    if with_set:  # every rank registers [0] and [1]; each then runs the cases alone in its own
        singles = [_process_set(hvd, [k]) for k in range(hvd.size())]
        sets = [hvd.global_process_set, singles[r]]
    out = {}
    for k, ps in enumerate(sets):
        for case, value, build in _cases(hvd, tf, r, ps):
            key = f"{case}@{k}"
            if mode == "v1":
                with tf.Graph().as_default():  # (a name per case: no case can complete another's op)
                    x = tf.constant(value, name=key.replace("@", "_"))
                    y = build(x)
                    dy = tf.compat.v1.placeholder(tf.float32, y.shape)  # static where known, as tf.ones(...) is
                    g = tf.gradients(y, x, grad_ys=dy)[0]
                    with tf.compat.v1.Session() as sess:
                        shape = sess.run(tf.shape(y))
                        out[key] = sess.run(g, {dy: upstream(shape, r)}).tolist()
                continue
            x = tf.Variable(value)

            def step(x=x, build=build):
                with tf.GradientTape() as tape:
                    y = build(x)
                    loss = tf.reduce_sum(y * tf.numpy_function(lambda s: upstream(s, r), [tf.shape(y)], tf.float32))
                return tape.gradient(loss, x)

            g = tf.function(step)() if mode == "function" else step()
            out[key] = None if g is None else np.asarray(g).tolist()
    hvd.barrier()  # rank 0 negotiates every set's collectives: it stays until the others are done
    return out


def repeated_gradients(times=5):
    """Every case's gradient built ``times`` times in one ``tf.compat.v1`` graph (``times``
    ``tf.gradients`` of one op) and evaluated in one ``Session.run`` (issue 54: their collectives
    met under one name).  Returns {case: [the gradient as lists] * times}."""
    import tensorflow as tf

    import sdp.compat_horovod.tensorflow as hvd
    r = hvd.rank()
    out = {}
    for case, value, build in _cases(hvd, tf, r, None):
        with tf.Graph().as_default():
            x = tf.constant(value, name=case)
            y = build(x)
            dy = tf.compat.v1.placeholder(tf.float32, y.shape)
            grads = [tf.gradients(y, x, grad_ys=dy)[0] for _ in range(times)]
            with tf.compat.v1.Session() as sess:
                shape = sess.run(tf.shape(y))
                out[case] = [g.tolist() for g in sess.run(grads, {dy: upstream(shape, r)})]
    hvd.barrier()
    return out


def error_classes(mode):
    """What each rank gets from collectives that Horovod fails with a TensorFlow status, ``mode``
    "eager", "function", "v1" (a ``tf.compat.v1.Session``) or "data" (the collective inside a
    ``tf.data`` ``map`` function).  Returns {case: [class names of the error's MRO that matter,
    message]}, the process-set cases, and eagerly the tape's and optimizer's."""
    import tensorflow as tf

    import sdp.common.errors as sdp_errors
    import sdp.compat_horovod.tensorflow as hvd
    r = hvd.rank()

    def run(build):
        if mode == "eager":
            return build()
        if mode == "function":
            return tf.function(build)()
        if mode == "data":
            return next(iter(tf.data.Dataset.from_tensors(0).map(lambda _: build())))
        with tf.Graph().as_default():
            y = build()
            with tf.compat.v1.Session() as sess:
                return sess.run(y)

    cases = {
        "shape": lambda: hvd.allreduce(tf.ones([r + 1]), name="shape_case"),
        "dtype": lambda: hvd.broadcast(tf.ones([2], tf.float32 if r == 0 else tf.float64), 0, name="dtype_case"),
        "root": lambda: hvd.broadcast(tf.ones([2]), r, name="root_case"),
        "splits": lambda: hvd.alltoall(tf.ones([4, 2]), splits=[2, 2 + r], name="splits_case")[0],
    }
    out = {}
    for case, build in cases.items():
        try:
            run(build)
            out[case] = ["no error", ""]
        except Exception as e:  # noqa: BLE001
            kinds = [k for k, cls in (("FailedPrecondition", tf.errors.FailedPreconditionError),
                                      ("InvalidArgument", tf.errors.InvalidArgumentError),
                                      ("SdpError", sdp_errors.SdpError),
                                      ("TensorMismatch", sdp_errors.TensorMismatchError)) if isinstance(e, cls)]
            out[case] = [kinds, str(e).splitlines()[0] if mode == "eager" else str(e)]
    if mode == "function":  # the same traced op fails, then succeeds: no failure is left behind
        again = tf.function(lambda x: hvd.allreduce(x, op=hvd.Sum, name="again_case"),
                            input_signature=[tf.TensorSpec(None, tf.float32)])
        try:
            again(tf.ones([r + 1]))
            out["again"] = ["no error"]
        except tf.errors.OpError as e:
            out["again"] = [type(e).__name__]
        out["again"].append([again(tf.ones([3]) * (r + 1)).numpy().tolist() for _ in range(3)])
    # a set of rank 0 alone: rank 1 calls its collective (and eagerly, its tape and optimizer)
    solo = hvd.add_process_set([0])
    try:
        run(lambda: hvd.allreduce(tf.ones([2]), process_set=solo, name="solo_case"))
        out["outside_set"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["outside_set"] = [isinstance(e, tf.errors.InvalidArgumentError), isinstance(e, ValueError),
                              isinstance(e, sdp_errors.SdpError), str(e)]
    if mode == "eager":
        w = tf.Variable([1.0, 2.0])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * (r + 1.0))
        tape = hvd.DistributedGradientTape(tape, process_set=solo)
        out["tape_outside_set"] = tape.gradient(loss, [w])[0].numpy().tolist()
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0), process_set=solo)
        out["optimizer_outside_set"] = [g.numpy().tolist() for g, _ in
                                        opt.compute_gradients(lambda: tf.reduce_sum(w * (r + 1.0)), [w])]
        hvd.barrier()
    return out


def local_and_global(mode):
    """Horovod's ``DistributedGradientTape.get_local_and_global_gradients`` eagerly or in a
    ``tf.function`` ("eager"/"function"): a source registered with ``register_local_source`` and
    a ``PartialDistributedGradientTape``'s local layer, each beside global sources; every loss is
    ``sum(w * (rank + 1))`` so a local gradient is ``rank + 1`` (divided by size when
    ``scale_local_gradients``) and a global one the mean over ranks.  Returns
    {case: [[kind, source name, gradient as list], ...]}."""
    import tensorflow as tf

    import sdp.compat_horovod.tensorflow as hvd
    r = hvd.rank()
    out = {}
    a = tf.Variable([1.0, 1.0], name="a")
    b = tf.Variable([1.0], name="b")
    c = tf.Variable([1.0, 1.0, 1.0], name="c")
    dense = tf.keras.layers.Dense(1, kernel_initializer="ones", name="head")
    dense.build((None, 2))

    def split(scale, partial):
        with tf.GradientTape() as tape:
            loss = (r + 1.0) * (tf.reduce_sum(a) + tf.reduce_sum(b) + tf.reduce_sum(c))
            if partial:
                loss += (r + 1.0) * tf.reduce_sum(dense(tf.ones([1, 2])))
        if partial:
            tape = hvd.PartialDistributedGradientTape(tape, local_layers=[dense], scale_local_gradients=scale)
            sources = [a, dense.kernel, b, dense.bias]
        else:
            tape = hvd.DistributedGradientTape(tape, scale_local_gradients=scale)
            tape.register_local_source(b)
            sources = [a, b, c]
        local, glob = tape.get_local_and_global_gradients(loss, sources)
        names[:] = [[kind, v.name.split(":")[0]] for kind, pairs in (("local", local), ("global", glob))
                    for v, _ in pairs]  # noted while tracing: a tf.function returns values, not variables
        return [g for _, g in local] + [g for _, g in glob]

    for case, scale, partial in (("registered", True, False), ("unscaled", False, False),
                                 ("partial", True, True)):
        names = []
        fn = (lambda s=scale, p=partial: split(s, p))
        grads = tf.function(fn)() if mode == "function" else fn()
        out[case] = [kn + [np.asarray(g).ravel().tolist()] for kn, g in zip(names, grads)]
    return out


def keras_lazy_model(steps=3):
    """Horovod's Keras MNIST pattern: a Sequential without an Input (built by its first batch),
    different initial weights per rank, fit with BroadcastGlobalVariablesCallback; a second
    model keeps its last layer local (PartialDistributedOptimizer + local_variables=).  Runs
    with Keras 3 or tf_keras (TF_USE_LEGACY_KERAS=1).  Returns the weights after fit."""
    import tensorflow as tf

    import sdp.compat_horovod.keras as hvd  # horovod.tensorflow.keras under --compat horovod
    r = hvd.rank()
    keras = tf.keras
    tf.random.set_seed(100 + r)  # a different initialization on every rank
    rng = np.random.default_rng(r)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = rng.normal(size=(16, 1)).astype(np.float32)

    model = keras.Sequential([keras.layers.Dense(3, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, steps_per_epoch=steps, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    out = {"lazy": [w.tolist() for w in model.get_weights()]}

    tf.random.set_seed(200 + r)
    local = keras.layers.Dense(1, name="local_head")
    part = keras.Sequential([keras.Input(shape=(4,)), keras.layers.Dense(3, activation="relu"), local])
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.01), local_layers=[local])
    part.compile(optimizer=opt, loss="mse")
    part.fit(x, y, batch_size=4, epochs=1, steps_per_epoch=steps, verbose=0,
             callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=local.trainable_weights)])
    out["partial"] = [w.tolist() for w in part.get_weights()]
    try:
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.01), local_layers=[object()])
        out["bad_layer"] = "no error"
    except ValueError as e:
        out["bad_layer"] = str(e)
    return out


def root_logger_debug():
    """KungFu's Keras example's first lines: the root logger at DEBUG, then sdp starts, runs a
    collective and stops (the ZAP authenticator logs at DEBUG on shutdown).  Returns the sdp
    logger's effective level."""
    import logging
    import sys

    logging.basicConfig(stream=sys.stderr, level=logging.DEBUG, format="ROOT %(name)s %(levelname)s %(message)s")
    import sdp
    sdp.init()
    sdp.allreduce(np.ones(4, np.float32), name="log_case")
    level = logging.getLogger("sdp").getEffectiveLevel()
    sdp.shutdown()
    return logging.getLevelName(level)


def diverging_tf1_loop(leaver, flag_path):
    """Rank ``leaver`` leaves a TF1 Session loop of allreduces after 2 steps (an assertion failed
    there) and goes on without collectives until the other rank's Session.run has failed (it
    writes ``flag_path``), then calls a collective.  Returns what each rank saw."""
    import os
    import time

    import tensorflow as tf

    import sdp.tensorflow as hvd
    r = hvd.rank()
    out = {}
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4])
        y = hvd.allreduce(x, name="loop_grad")
        with tf.compat.v1.Session() as sess:
            try:
                for step in range(5):
                    if r == leaver and step == 2:
                        break
                    sess.run(y, {x: np.ones(4, np.float32)})
                out["loop"] = "left"
            except tf.errors.OpError as e:
                out["loop"] = [type(e).__name__, "StallError" in str(e), "'loop_grad'" in str(e)]
                with open(flag_path + ".tmp", "w") as f:
                    f.write("failed")
                os.replace(flag_path + ".tmp", flag_path)
    if r == leaver:
        while not os.path.exists(flag_path):  # the other rank is blocked in Session.run until the stall ends it
            time.sleep(0.05)
        try:
            hvd.allreduce(tf.ones([2]), name="after_loop")
            out["after"] = "no error"
        except Exception as e:  # noqa: BLE001
            out["after"] = [type(e).__name__, str(e)]
    return out
