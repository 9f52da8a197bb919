"""Workers for tests/test_tf_fidelity.py (issue 31): Horovod's behaviour where a script notices it,
run inside real rank processes (gradients of every collective, TensorFlow's error classes)."""
import numpy as np


def upstream(shape, r):
    """The gradient arriving at a collective's output on rank ``r`` (differs per rank)."""
    return ((np.arange(int(np.prod(shape))).reshape(shape) + 1) * 0.5 * (r + 1)).astype(np.float32)


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
        singles = [hvd.add_process_set([k]) for k in range(hvd.size())]
        sets = [hvd.global_process_set, singles[r]]
    out = {}
    for k, ps in enumerate(sets):
        for case, value, build in _cases(hvd, tf, r, ps):
            key = f"{case}@{k}"
            if mode == "v1":
                with tf.Graph().as_default():
                    x = tf.constant(value)
                    y = build(x)
                    dy = tf.compat.v1.placeholder(tf.float32, None)
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
    return out
