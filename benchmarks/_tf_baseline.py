"""TensorFlow baseline for ``benchmarks/allreduce.py``: one worker of a 2-worker
``tf.distribute.MultiWorkerMirroredStrategy`` (RING collectives over gRPC on 127.0.0.1).

Started by ranks 0 and 1 of the sdp benchmark (after sdp's own measurements), one process each::

    python benchmarks/_tf_baseline.py --index I --ports P0,P1 --sizes 1024,65536 --out DIR

Each worker writes ``DIR/tf_<index>.json``: per size, the per-iteration wall times of
``replica_context.all_reduce(SUM, x)`` inside a ``tf.function``.  Not meant to be run by hand
(but it can be: start both indices with the same ports).
"""
import argparse
import json
import os
import statistics
import sys
import time


def _plan_iters(est_s: float, target_s: float, lo: int, hi: int) -> int:
    return int(max(lo, min(hi, round(target_s / max(est_s, 1e-7)))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--index", type=int, required=True, help="worker index (0 or 1)")
    p.add_argument("--ports", required=True, help="comma-separated ports of the workers on 127.0.0.1")
    p.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=0, help="timed iterations per size (0: ~--target-s each)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--target-s", type=float, default=1.0)
    p.add_argument("--min-iters", type=int, default=5)
    p.add_argument("--max-iters", type=int, default=1000)
    p.add_argument("--out", required=True, help="directory for tf_<index>.json")
    a = p.parse_args(argv)

    ports = [int(x) for x in a.ports.split(",")]
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{port}" for port in ports]},
        "task": {"type": "worker", "index": a.index}})
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    # The strategy must be created before any other TF op runs in this process.
    comm = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)
    nworkers = strategy.num_replicas_in_sync
    dtype = tf.as_dtype(np.dtype(a.dtype))

    device = strategy.extended.worker_devices[0]

    @tf.function
    def allreduce(x):
        def fn(v):
            # a tensor without a device inside tf.function is rejected ("destinations can not be
            # empty"): pin it to this worker's device, as a variable or dataset element would be
            with tf.device(device):
                v = tf.identity(v)
            return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, v)
        return strategy.run(fn, args=(x,))

    def agree(value: float) -> float:
        """The mean of ``value`` over both workers (identical bits on both: a+b == b+a)."""
        s = allreduce(tf.constant([value], tf.float64))
        return float(s.numpy()[0]) / nworkers

    results = []
    for nbytes in [int(s) for s in a.sizes.split(",")]:
        count = max(1, nbytes // np.dtype(a.dtype).itemsize)
        x = tf.ones([count], dtype=dtype)
        last = 0.0
        for _ in range(max(1, a.warmup)):
            t0 = time.perf_counter()
            allreduce(x)
            last = time.perf_counter() - t0
        iters = a.iters or _plan_iters(agree(last), a.target_s, a.min_iters, a.max_iters)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            allreduce(x)  # eager call of a tf.function: returns once the collective is done
            times.append(time.perf_counter() - t0)
        results.append({"bytes": count * np.dtype(a.dtype).itemsize, "count": count, "iters": iters,
                        "median_s": statistics.median(times),
                        "p90_s": float(np.percentile(times, 90)), "times_s": times})
        if a.index == 0:
            print(f"tf  {results[-1]['bytes']:>11d} B  median {results[-1]['median_s'] * 1e6:12.1f} us"
                  f"  ({iters} iters)", flush=True)
        del x
    out = {"index": a.index, "workers": nworkers, "tf_version": tf.__version__, "results": results}
    path = os.path.join(a.out, f"tf_{a.index}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
