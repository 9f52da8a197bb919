"""What sdp's compiled ``SdpCheck`` op costs a graph collective (issue 31, item 2).

    sdprun -np 2 python benchmarks/tf_check_op.py [--rounds 30] [--iters 200] [--bytes 1024]

Two ``tf.function``s doing the same SUM allreduce of ``--bytes`` float32 bytes: ``check`` traced
with the compiled op (a ``numpy_function`` returning its result plus a status, then ``SdpCheck``)
and ``fallback`` traced with ``SDP_TF_OPS=0`` (the plain ``numpy_function``).  They run
alternately, ``--rounds`` rounds of ``--iters`` calls each, so a slow stretch of the machine hits
both alike; rank 0 prints the median over rounds of each round's median (the maximum over ranks)
and the difference.  The library is built first if it is not in the cache.
"""
import argparse
import os
import statistics
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--bytes", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=50)
    args = p.parse_args(argv)

    import tensorflow as tf

    import sdp.tensorflow as hvd
    from sdp.tensorflow import build_ops
    hvd.init()
    x = tf.constant(np.ones(args.bytes // 4, np.float32))
    fns = {}
    for mode, switch in (("fallback", "0"), ("check", "1")):
        os.environ[build_ops.SWITCH] = switch  # read when the collective's ops are built
        fn = tf.function(lambda t, mode=mode: hvd.allreduce(t, op=hvd.Sum, name=f"bench.{mode}"))
        fn.get_concrete_function(x)
        ops = {o.type for o in fn.get_concrete_function(x).graph.get_operations()}
        assert ("SdpCheck" in ops) == (mode == "check"), (mode, sorted(ops))
        fns[mode] = fn
    os.environ.pop(build_ops.SWITCH)

    def median_of(fn) -> float:
        hvd.barrier()
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    for fn in fns.values():
        for _ in range(args.warmup):
            fn(x)
    per_round = {mode: [] for mode in fns}
    for r in range(args.rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(list(fns)))
        for mode in order:
            per_round[mode].append(median_of(fns[mode]))
    med = {}
    for mode, meds in per_round.items():
        mine = statistics.median(meds)
        med[mode] = float(hvd.allreduce(tf.constant(mine, tf.float64), op=hvd.Max, name=f"bench.max.{mode}"))
    diffs = [c - f for c, f in zip(per_round["check"], per_round["fallback"])]
    diff = float(hvd.allreduce(tf.constant(statistics.median(diffs), tf.float64), op=hvd.Max, name="bench.diff"))
    if hvd.rank() == 0:
        load = " ".join(f"{v:.2f}" for v in os.getloadavg())
        print(f"tf.function allreduce of {args.bytes} B, {hvd.size()} ranks, {args.rounds} alternating rounds of "
              f"{args.iters} calls (median of round medians, max over ranks), load [{load}]")
        print(f"  fallback (numpy_function only): {med['fallback'] * 1e6:8.1f} us")
        print(f"  check (numpy_function + SdpCheck): {med['check'] * 1e6:8.1f} us")
        print(f"  check - fallback: {(med['check'] - med['fallback']) * 1e6:+.1f} us "
              f"(median of per-round differences: {diff * 1e6:+.1f} us)")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
