"""Workers for tests/test_tf_graph_deadlock.py: graphs holding many independent collectives,
created in a different order on each rank, run in a ``tf.compat.v1.Session`` and in a
``tf.function`` with a given number of TensorFlow inter-op threads.  TensorFlow is imported
inside the functions so that the thread count is set before TensorFlow initializes."""
import gc
import time

import numpy as np

KINDS = ("allreduce", "allgather", "broadcast", "grouped", "grouped_sparse", "reducescatter", "alltoall")


def data(i, rank):
    """Input of op ``i`` on ``rank`` (float32; allgather inputs have ``rank + 1`` rows)."""
    kind = KINDS[i % len(KINDS)]
    rows = rank + 1 if kind == "allgather" else 4
    return (np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) + 100 * i + 10 * rank + 1)


def creation_order(n, rank):
    """A different order on every rank: reversed on odd ranks, rotated by the rank on even ones."""
    idx = list(range(n))
    return idx[::-1] if rank % 2 else idx[rank:] + idx[:rank]


def _build(hvd, tf, n, rank, size):
    inputs = [tf.constant(data(i, rank)) for i in range(n)]  # same names on every rank
    outs = [None] * n
    for i in creation_order(n, rank):
        x, kind = inputs[i], KINDS[i % len(KINDS)]
        if kind == "allreduce":
            outs[i] = [hvd.allreduce(x, op=hvd.Sum)]
        elif kind == "allgather":
            outs[i] = [hvd.allgather(x)]
        elif kind == "broadcast":
            outs[i] = [hvd.broadcast(x, root_rank=i % size)]
        elif kind == "grouped":
            outs[i] = hvd.grouped_allreduce([x, 2 * x], op=hvd.Average, name=f"grouped.{i}")
        elif kind == "grouped_sparse":
            sparse = tf.IndexedSlices(x[:1], tf.constant([rank], tf.int64), dense_shape=tf.constant([4, 2], tf.int64))
            dense, sp = hvd.grouped_allreduce([x, sparse], op=hvd.Sum, name=f"mixed.{i}")
            outs[i] = [dense, tf.convert_to_tensor(sp)]
        elif kind == "reducescatter":
            outs[i] = [hvd.reducescatter(x, op=hvd.Sum)]
        else:
            outs[i] = [hvd.alltoall(x)]
    return outs


def graphs(n, threads, steps=2):
    """Build ``n`` collectives (cycling through KINDS) in this rank's order; run them ``steps``
    times in one ``tf.function`` and in one ``tf.compat.v1.Session``, with ``threads`` inter-op
    threads (0: TensorFlow's default).  Returns {mode: [results of every step], "seconds": ...}."""
    import tensorflow as tf
    if threads:
        tf.config.threading.set_inter_op_parallelism_threads(threads)

    import sdp.tensorflow as hvd
    rank, size = hvd.rank(), hvd.size()
    out = {"threads": tf.config.threading.get_inter_op_parallelism_threads()}

    @tf.function(autograph=False)  # (converting _build takes seconds; sdp's own code is never converted)
    def step():
        return _build(hvd, tf, n, rank, size)

    t0 = time.monotonic()
    step.get_concrete_function()
    out["trace_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    out["function"] = []
    for _ in range(steps):
        out["function"].append([[o.numpy().tolist() for o in op] for op in step()])
        gc.collect()  # the function's wait ops keep their iterators across collections
    out["function_s"] = time.monotonic() - t0

    with tf.Graph().as_default():
        fetches = _build(hvd, tf, n, rank, size)
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads)
        with tf.compat.v1.Session(config=config) as sess:
            t0 = time.monotonic()
            out["session"] = [[[o.tolist() for o in op] for op in sess.run(fetches)] for _ in range(steps)]
            out["session_s"] = time.monotonic() - t0
    return out


def eager_gradients():
    """Eager collectives (no py_function) with and without a tape: values and gradients."""
    import tensorflow as tf

    import sdp.tensorflow as hvd
    r = hvd.rank()
    x = tf.Variable(data(0, r))
    res = {"allreduce": hvd.allreduce(x, op=hvd.Sum).numpy().tolist(),
           "grouped": [t.numpy().tolist() for t in hvd.grouped_allreduce([x, 3 * x], op=hvd.Average)],
           "allgather": hvd.allgather(x[: r + 1]).numpy().tolist(),
           "broadcast": hvd.broadcast(x, root_rank=1).numpy().tolist()}
    with tf.GradientTape(persistent=True) as tape:
        y = hvd.allreduce(x * x, op=hvd.Sum)          # d/dx sum_r(x_r^2) -> allreduce of 2x
        z = hvd.grouped_allreduce([x, 5 * x], op=hvd.Average)
        loss_y = tf.reduce_sum(y)
        loss_z = tf.reduce_sum(z[0]) + tf.reduce_sum(z[1])
    res["grad_allreduce"] = tape.gradient(loss_y, x).numpy().tolist()
    res["grad_grouped"] = tape.gradient(loss_z, x).numpy().tolist()
    # a DistributedGradientTape step: the averaged gradient of sum(w * x_r)
    w = tf.Variable(tf.ones([4, 2]))
    with tf.GradientTape() as t2:
        loss = tf.reduce_sum(w * tf.constant(data(2, r)))
    res["tape"] = hvd.DistributedGradientTape(t2).gradient(loss, [w])[0].numpy().tolist()
    res["is_tensor"] = all(isinstance(v, tf.Tensor) for v in [hvd.allreduce(x)])
    return res


def first_batch_broadcast(threads, steps=3):
    """Horovod's TF2 training step: ``DistributedGradientTape`` gradients applied, then on the
    first batch ``broadcast_variables`` of the model's and the optimizer's variables, all in one
    ``tf.function`` (the broadcast reads the variables the applied gradients just updated).
    Every rank starts from different weights.  Returns the initial and final weights, losses."""
    import tensorflow as tf
    if threads:
        tf.config.threading.set_inter_op_parallelism_threads(threads)

    import sdp.tensorflow as hvd
    rank = hvd.rank()
    tf.keras.utils.set_random_seed(rank)  # different initial weights on every rank
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3), tf.keras.layers.Dense(1)])
    opt = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    x = tf.constant(data(0, rank))[:, :1] * tf.ones([1, 4]) / 100.0
    y = tf.reduce_sum(x, axis=1, keepdims=True)
    initial = [v.numpy().tolist() for v in model.variables]

    @tf.function
    def train_step(first_batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    t0 = time.monotonic()
    losses = [float(train_step(step == 0)) for step in range(steps)]  # a Python bool, as Horovod passes
    return {"threads": tf.config.threading.get_inter_op_parallelism_threads(), "initial": initial,
            "final": [v.numpy().tolist() for v in model.variables], "losses": losses,
            "seconds": time.monotonic() - t0}
