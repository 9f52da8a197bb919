"""Does gradient communication hide behind TensorFlow's backward pass?

    sdprun -np 2 python benchmarks/tf_overlap.py [--steps 20] [--caps 0,4M,16M,25M,1G]

An MLP (``--width`` units x ``--layers`` dense layers, float32; ~59 MB of gradients by default)
trains with ``sdp.tensorflow.DistributedGradientTape`` inside ``tf.function``.  The tape hands
gradients to the engine in buckets of at most the fusion threshold (walked from the last layer
to the first, the order the backward pass produces them), each as soon as its gradients exist,
and one op waits for all of them.  Per bucket cap (``--caps``, bytes; the fusion threshold for
that run, set with ``sdp.set_fusion_threshold`` before tracing; 0 = one bucket per gradient)
rank 0 prints the median step time (max over ranks) next to:

* ``compute``: the same step with a plain ``tf.GradientTape`` (no communication);
* ``comm``: the gradient list alone, ``sdp.grouped_allreduce`` of numpy arrays of the same shapes.

``hidden = (compute + comm - step) / min(compute, comm)``: 100% when the shorter is entirely
hidden, 0% when they run one after the other.
"""
import argparse
import statistics
import time

import numpy as np
import tensorflow as tf

import sdp.tensorflow as sdp
from sdpbench.common import max_over_ranks, parse_size  # benchmarks/sdpbench/: the benchmarks' shared helpers
from sdp import api


def timed(fn, steps: int, name: str) -> float:
    fn()  # trace / warm up
    fn()
    times = []
    for _ in range(steps):
        api.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return max_over_ranks(statistics.median(times), name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--caps", default="0,4M,16M,25M,1G", help="fusion thresholds to try (bytes)")
    args = p.parse_args()
    sdp.init()
    tf.random.set_seed(1)
    layers = [tf.keras.layers.Dense(args.width, activation="relu") for _ in range(args.layers)]
    model = tf.keras.Sequential(layers + [tf.keras.layers.Dense(10)])
    model.build((None, args.width // 2))
    x = tf.random.normal([args.batch, args.width // 2])
    y = tf.random.uniform([args.batch], 0, 10, tf.int32)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    nbytes = sum(int(np.prod(v.shape)) * 4 for v in variables)

    def make_step(distributed: bool):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            if distributed:
                tape = sdp.DistributedGradientTape(tape)
            grads = tape.gradient(loss, variables)
            return tf.add_n([tf.reduce_sum(g) for g in grads])  # every gradient is needed
        return lambda: step().numpy()

    compute = timed(make_step(False), args.steps, "compute")
    arrays = [np.ones(v.shape, np.float32) for v in variables]
    comm = timed(lambda: api.grouped_allreduce(arrays, name="comm"), args.steps, "comm")
    default = api.fusion_threshold()
    rows = []
    for cap in [parse_size(c) for c in args.caps.split(",") if c.strip()]:
        api.set_fusion_threshold(cap)
        t = timed(make_step(True), args.steps, f"step.{cap}")
        rows.append((cap, t))
    api.set_fusion_threshold(default)
    if sdp.rank() == 0:
        print(f"{len(variables)} gradients, {nbytes / 2**20:.1f} MB, {sdp.size()} ranks, batch {args.batch}, "
              f"median of {args.steps} steps, max over ranks", flush=True)
        print(f"compute (plain tape): {compute * 1e3:.2f} ms   comm (grouped_allreduce alone): {comm * 1e3:.2f} ms",
              flush=True)
        print(f"{'bucket cap':>12} {'buckets':>8} {'step(ms)':>10} {'hidden':>8}", flush=True)
        sizes = [int(np.prod(v.shape)) * 4 for v in variables][::-1]
        for cap, t in rows:
            buckets, fill = 0, None
            for s in sizes:
                if fill is None or not cap or fill + s > cap:
                    buckets, fill = buckets + 1, 0
                fill += s
            hidden = (compute + comm - t) / min(compute, comm)
            print(f"{cap:>12d} {buckets:>8d} {t * 1e3:10.2f} {hidden:8.0%}", flush=True)
    sdp.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
