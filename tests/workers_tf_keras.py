"""Workers for tests/test_tf_keras.py (and, with TF_USE_LEGACY_KERAS=1, tests/test_tf_legacy_keras.py):
Keras DistributedOptimizer, callbacks and load_model inside real rank processes.

Every rank can rebuild every rank's data (``_shard``), so rank 0 also trains a plain,
single-process reference on the concatenated batches and returns both results."""
import numpy as np

BATCH = 4


def _shard(rank, steps, seed=0, features=5):
    rng = np.random.default_rng(seed + 1000 * rank)
    x = rng.normal(size=(steps * BATCH, features)).astype(np.float32)
    y = (x @ np.arange(1, features + 1, dtype=np.float32)[:, None] * 0.1 + rng.normal(size=(steps * BATCH, 1)) * 0.01
         ).astype(np.float32)
    return x, y


def _concat_batches(size, steps):
    """Step i of single-process training sees the i-th batch of every rank, concatenated."""
    shards = [_shard(r, steps) for r in range(size)]
    xs, ys = [], []
    for i in range(steps):
        for x, y in shards:
            xs.append(x[i * BATCH:(i + 1) * BATCH])
            ys.append(y[i * BATCH:(i + 1) * BATCH])
    return np.concatenate(xs), np.concatenate(ys)


def _model(tf, seed):
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([tf.keras.Input((5,)), tf.keras.layers.Dense(4, activation="tanh"),
                                tf.keras.layers.Dense(1)])


def _weights(model):
    return [w.tolist() for w in model.get_weights()]


def _legacy_sgd(tf, lr, legacy):
    return tf.keras.optimizers.legacy.SGD(lr) if legacy else tf.keras.optimizers.SGD(lr)


def sgd_fit_matches_single_process(steps, legacy=False, steps_per_execution=1):
    """model.fit with a wrapped SGD on each rank's shard == plain SGD on the concatenated batches.
    ``steps_per_execution`` > 1 runs several steps in one traced loop (the same collective names
    in every iteration)."""
    import tensorflow as tf

    import sdp.tensorflow.keras as hvd
    r, n = hvd.rank(), hvd.size()
    model = _model(tf, seed=r)  # different initial weights per rank: the callback must fix that
    opt = hvd.DistributedOptimizer(_legacy_sgd(tf, 0.1, legacy))
    model.compile(optimizer=opt, loss="mse", steps_per_execution=steps_per_execution)
    x, y = _shard(r, steps)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    out = {"weights": _weights(model), "is_sgd": isinstance(opt, type(_legacy_sgd(tf, 0.1, legacy))),
           "iterations": int(opt.iterations.numpy()), "n_vars_called": len(opt.variables())}
    if r == 0:
        ref = _model(tf, seed=0)
        ref.compile(optimizer=_legacy_sgd(tf, 0.1, legacy), loss="mse")
        cx, cy = _concat_batches(n, steps)
        ref.fit(cx, cy, batch_size=BATCH * n, epochs=1, shuffle=False, verbose=0)
        out["reference"] = _weights(ref)
    return out


def adam_custom_loop(steps, legacy=False):
    """apply_gradients in a tf.function with a wrapped Adam: every rank ends with the same weights,
    equal to a single-process Adam on the concatenated batches."""
    import tensorflow as tf

    import sdp.tensorflow as hvd
    r, n = hvd.rank(), hvd.size()

    def train(model, opt, batches):
        loss_fn = tf.keras.losses.MeanSquaredError()

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        for x, y in batches:
            step(x, y)

    adam = tf.keras.optimizers.legacy.Adam if legacy else tf.keras.optimizers.Adam
    model = _model(tf, seed=0)
    opt = hvd.DistributedOptimizer(adam(0.01))
    x, y = _shard(r, steps)
    train(model, opt, [(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]) for i in range(steps)])
    out = {"weights": _weights(model)}
    if r == 0:
        ref = _model(tf, seed=0)
        cx, cy = _concat_batches(n, steps)
        b = BATCH * n
        train(ref, adam(0.01), [(cx[i * b:(i + 1) * b], cy[i * b:(i + 1) * b]) for i in range(steps)])
        out["reference"] = _weights(ref)
    return out


def _aggregation(tf, hvd, sgd, passes):
    """backward_passes_per_step=2, averaged: returns (w after every pass, optimizer iterations)."""
    r = hvd.rank()
    w = tf.Variable(np.ones(3, np.float32))
    opt = hvd.DistributedOptimizer(sgd, backward_passes_per_step=2, average_aggregated_gradients=True)

    @tf.function
    def step(g):
        opt.apply_gradients([(g, w)])

    trace = []
    for p in range(passes):
        step(tf.constant(np.float32(r + 1) * np.arange(1, 4, dtype=np.float32) * (p + 1)))
        trace.append(w.numpy().tolist())
    return trace, int(opt.iterations.numpy())


def aggregation_and_sparse(passes):
    """backward_passes_per_step=2 (averaged) and an Embedding (IndexedSlices gradients, allgathered
    or densified) vs. references computed by hand on rank 0."""
    import tensorflow as tf

    import sdp.tensorflow.keras as hvd
    r, n = hvd.rank(), hvd.size()
    out = {}

    out["agg_trace"], out["agg_iterations"] = _aggregation(tf, hvd, tf.keras.optimizers.SGD(0.1), passes)

    # -- embedding gradients: allgathered IndexedSlices, or densified
    for label, as_dense in (("sparse", False), ("dense", True)):
        tf.keras.utils.set_random_seed(0)
        model = tf.keras.Sequential([tf.keras.Input((2,), dtype="int32"), tf.keras.layers.Embedding(6, 3),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
        opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.5), sparse_as_dense=as_dense)
        ids = np.array([[r, 4], [2 + r, 4]], np.int32)
        target = np.array([[1.0], [-1.0]], np.float32) * (r + 1)
        seen = {}

        @tf.function
        def emb_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            seen["sparse"] = isinstance(grads[0], tf.IndexedSlices)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        for _ in range(2):
            emb_step(ids, target)
        out[label] = {"weights": _weights(model), "sparse_grad": seen["sparse"]}
    if r == 0:
        tf.keras.utils.set_random_seed(0)
        ref = tf.keras.Sequential([tf.keras.Input((2,), dtype="int32"), tf.keras.layers.Embedding(6, 3),
                                   tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
        ref_opt = tf.keras.optimizers.SGD(0.5)
        allx = np.concatenate([np.array([[q, 4], [2 + q, 4]], np.int32) for q in range(n)])
        ally = np.concatenate([np.array([[1.0], [-1.0]], np.float32) * (q + 1) for q in range(n)])
        for _ in range(2):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((ref(allx) - ally) ** 2)
            grads = tape.gradient(loss, ref.trainable_variables)
            ref_opt.apply_gradients(zip(grads, ref.trainable_variables))
        out["reference"] = _weights(ref)
    return out


def fit_callbacks_save_resume(workdir, epochs):
    """fit with every callback, rank 0 saves, every rank loads with load_model and resumes."""
    import os

    import tensorflow as tf

    import sdp.tensorflow.keras as hvd
    r, n = hvd.rank(), hvd.size()
    x, y = _shard(r, 6, seed=7)
    vx, vy = _shard(r, 2, seed=99)
    model = _model(tf, seed=r)
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9))
    model.compile(optimizer=opt, loss="mse", metrics=["mae"])
    lrs = []
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.05, warmup_epochs=2, verbose=1),
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.05, multiplier=0.5, start_epoch=2),
        tf.keras.callbacks.LambdaCallback(
            on_train_batch_begin=lambda b, logs: lrs.append(hvd.callbacks.get_learning_rate(model.optimizer))),
    ]
    best = os.path.join(workdir, "best.keras")
    if r == 0:
        callbacks.append(hvd.callbacks.BestModelCheckpoint(monitor="val_loss", filepath=best))
    hist = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, validation_data=(vx, vy),
                     callbacks=callbacks)
    out = {"history": {k: [float(v) for v in vals] for k, vals in hist.history.items()},
           "lrs": lrs, "weights": _weights(model), "iterations": int(opt.iterations.numpy())}
    path = os.path.join(workdir, "model.keras")
    if r == 0:
        model.save(path)
        out["best_saved"] = os.path.exists(best)
    hvd.allreduce(0, name="saved")  # barrier: the file exists before anybody loads it
    loaded = hvd.load_model(path)
    out["loaded_weights_equal"] = all(np.array_equal(a, b) for a, b in zip(loaded.get_weights(), model.get_weights()))
    out["loaded_iterations"] = int(loaded.optimizer.iterations.numpy())
    out["loaded_is_distributed"] = hasattr(loaded.optimizer, "register_local_var")
    out["loaded_class"] = type(loaded.optimizer).__name__
    loaded.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    out["resumed_weights"] = _weights(loaded)
    out["resumed_iterations"] = int(loaded.optimizer.iterations.numpy())
    return out


def xla(steps):
    """jit_compile=True: the callback turns XLA off (with a warning); without it, a clear error."""
    import warnings

    import tensorflow as tf

    import sdp.tensorflow.keras as hvd
    r = hvd.rank()
    x, y = _shard(r, steps)
    out = {}
    model = _model(tf, seed=0)
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    out["warned"] = any("jit_compile" in str(w.message) for w in caught)
    out["jit_after"] = bool(model.jit_compile)
    model = _model(tf, seed=0)
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True)
    try:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        out["error"] = None
    except Exception as e:  # noqa: BLE001
        out["error"] = type(e).__name__
        out["message"] = str(e)[:400]
    return out


def legacy_keras_suite(steps):
    """tf_keras (TF_USE_LEGACY_KERAS=1): new and legacy SGD with fit, legacy Adam in a custom loop."""
    import tensorflow as tf
    assert tf.keras.__name__.startswith("tf_keras"), tf.keras.__name__
    return {"sgd": sgd_fit_matches_single_process(steps, legacy=False),
            "legacy_sgd": sgd_fit_matches_single_process(steps, legacy=True),
            "legacy_adam": adam_custom_loop(steps, legacy=True),
            "aggregation": _aggregation(tf, hvd_keras(), tf.keras.optimizers.SGD(0.1), steps),
            "legacy_aggregation": _aggregation(tf, hvd_keras(), tf.keras.optimizers.legacy.SGD(0.1), steps)}


def hvd_keras():
    import sdp.tensorflow.keras as hvd
    return hvd


def legacy_hooks(bpps=2):
    """Horovod's optimizer hooks on tf_keras (issue 54): ``_compute_gradients`` returns the reduced
    gradients and ``apply_gradients`` applies them as they are (op=Sum: a second reduction would
    show), for the new and the legacy SGD; ``_agg_helper.counter`` with ``backward_passes_per_step``."""
    import tensorflow as tf

    import sdp.tensorflow.keras as hvd
    r = hvd.rank()
    out = {}
    for kind, cls in (("sgd", tf.keras.optimizers.SGD), ("legacy_sgd", tf.keras.optimizers.legacy.SGD)):
        x = tf.Variable([1.0, 2.0])
        opt = hvd.DistributedOptimizer(cls(0.1), op=hvd.Sum)
        pairs = opt._compute_gradients(lambda: tf.reduce_sum(x * (r + 1.0)), [x])
        opt.apply_gradients(pairs)
        out[kind] = [pairs[0][0].numpy().tolist(), x.numpy().tolist(), opt._agg_helper is None]
    x = tf.Variable([1.0])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), backward_passes_per_step=bpps)
    counters = []
    for _ in range(3):
        opt.apply_gradients(opt._compute_gradients(lambda: tf.reduce_sum(x * (r + 1.0)), [x]))
        counters.append(int(opt._agg_helper.counter.numpy()))
    out["aggregation"] = [counters, x.numpy().tolist()]
    return out
