"""Workers for tests/test_kungfu_graph_deadlock.py: KungFu's ``all_reduce`` operators, many
independent ones built in a different order on each worker, in one ``tf.function`` with a given
number of TensorFlow inter-op threads.  TensorFlow is imported inside the function so that the
thread count is set before TensorFlow initializes."""
import time

import numpy as np

from workers_tf_graph import creation_order


def data(i, rank):
    """Input of op ``i`` on ``rank`` (float32, 4 x 2)."""
    return np.arange(8, dtype=np.float32).reshape(4, 2) + 100 * i + 10 * rank + 1


def all_reduces(n, threads, steps=2):
    """``n`` ``all_reduce`` ops (SUM), op ``i`` built inside ``tf.name_scope('op<i>')`` (KungFu
    names an operator by its graph name, so the scope makes op ``i`` match across workers
    whatever the creation order), created in this rank's order; runs the function ``steps`` times.
    Returns {"threads", "results": [per step: n lists], "seconds"}."""
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(threads)

    import sdp_kungfu_bridge.python as kf
    from sdp_kungfu_bridge.tensorflow import ops

    rank = kf.current_rank()
    inputs = [tf.constant(data(i, rank)) for i in range(n)]

    @tf.function(autograph=False)
    def step():
        outs = [None] * n
        for i in creation_order(n, rank):
            with tf.name_scope(f"op{i}"):
                outs[i] = ops.all_reduce(inputs[i])
        return outs

    step.get_concrete_function()
    t0 = time.monotonic()
    results = [[o.numpy().tolist() for o in step()] for _ in range(steps)]
    return {"threads": tf.config.threading.get_inter_op_parallelism_threads(), "results": results,
            "seconds": time.monotonic() - t0}
