"""``kungfu.tensorflow.v1.benchmarks``: an allreduce benchmark on fake data (one variable of ones
per size) in a ``tf.compat.v1`` session, on sdp's engine.

``all_reduce_benchmark(sizes, dtype=tf.float32, method="CPU", warmup_steps=5, bench_steps=10)``
prints KungFu's lines (``all reduce N tensors of total size: ...``, ``step k, took ...s,
equivalent data rate: ...``; the rate counts ``4 * (np - 1)`` times the bytes, KungFu's
convention) and returns the list of step durations (seconds) and the reduced values of the last
step.  ``method``: ``"CPU"`` or ``"NCCL"`` (both sdp's ``group_all_reduce``: sdp has no NCCL) or
``"HOROVOD"`` (``horovod.tensorflow.allreduce(..., average=False)`` per tensor, sdp's).
Run as ``sdprun --compat kungfu -np 2 python -m kungfu.tensorflow.v1.benchmarks --model ResNet50``
(``--model`` ResNet50 | VGG16, ``--method``, ``--fuse``: one tensor of the total size).
"""
import time

import tensorflow as tf

from sdp_kungfu_bridge.python import current_cluster_size
from sdp_kungfu_bridge.tensorflow.ops import group_all_reduce, group_nccl_all_reduce
from sdp_kungfu_bridge.tensorflow.v1.helpers.utils import show_rate, show_size


def _hvd_group_all_reduce(ts):
    import sdp.tensorflow as hvd
    return [hvd.allreduce(t, average=False) for t in ts]


_GROUP_ALL_REDUCE = {"CPU": group_all_reduce, "NCCL": group_nccl_all_reduce, "HOROVOD": _hvd_group_all_reduce}


def all_reduce_benchmark(sizes, dtype=tf.float32, method="CPU", warmup_steps=5, bench_steps=10):
    if method not in _GROUP_ALL_REDUCE:
        raise ValueError(f"method={method!r}: expected CPU | NCCL | HOROVOD")
    durations = []
    with tf.Graph().as_default():
        xs = [tf.compat.v1.Variable(tf.ones([n], dtype)) for n in sizes]
        tot_size = sum(int(n) * tf.as_dtype(dtype).size for n in sizes)
        np_ = current_cluster_size()
        multiplier = 4 * (np_ - 1)
        print("all reduce %d tensors of total size: %s among %d peers, using %s" %
              (len(sizes), show_size(tot_size), np_, method), flush=True)
        ys = _GROUP_ALL_REDUCE[method](xs)
        with tf.compat.v1.Session() as sess:
            t0 = time.perf_counter()
            sess.run(tf.compat.v1.global_variables_initializer())
            print("tensorflow init took %.fs" % (time.perf_counter() - t0))
            out = None
            for phase, steps in (("warmup step", warmup_steps), ("step", bench_steps)):
                for step in range(1, steps + 1):
                    t0 = time.perf_counter()
                    out = sess.run(ys)
                    d = time.perf_counter() - t0
                    if phase == "step":
                        durations.append(d)
                    print("%s %d, took %.2fs, equivalent data rate: %s" %
                          (phase, step, d, show_rate(tot_size * multiplier, d)), flush=True)
    return durations, out
