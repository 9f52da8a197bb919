"""Small allreduces before and after ``join()``: the fast lane is on again after each join
(``sdp.engine.lane.Lane.rearm``), so what a job runs after a join costs what it cost before.

Run under the launcher (every rank on one host)::

    sdprun -np 2 python benchmarks/join.py
    sdprun -np 2 python benchmarks/join.py --joins 3 --iters 2000

Rank 0 prints one line per phase: the median time of one synchronous ``sdp.allreduce`` of 1 KB
(float32, SUM) back to back, this rank's, in us, before any join and after each of ``--joins``
joins (every rank joins at once), and the cost of each ``join()`` itself.  No target: a table
to compare (``benchmarks/README.md``).
"""
import argparse
import os
import sys
import time

import numpy as np

import sdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sdpbench.common import median_call_time  # noqa: E402  (benchmarks/sdpbench/)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--joins", type=int, default=2, help="joins to time after (default 2)")
    ap.add_argument("--iters", type=int, default=2000, help="allreduces timed per phase (default 2000)")
    args = ap.parse_args(argv)
    sdp.init()
    a = np.ones(256, np.float32)

    def call():
        sdp.allreduce(a, name="join.bench", op=sdp.Sum)

    rows = [("before join()", median_call_time(call, args.iters, warmup=100), None)]
    for j in range(args.joins):
        t0 = time.perf_counter()
        sdp.join()
        took = time.perf_counter() - t0
        rows.append((f"after join() {j + 1}", median_call_time(call, args.iters, warmup=100), took))
    if sdp.rank() == 0:
        lane = sdp.api.runtime().lane
        print(f"1 KB allreduce, {sdp.size()} ranks, fast lane {'on' if lane is not None and not lane.off else 'off'}")
        print("| phase | 1 KB allreduce, us | join() itself, ms |\n|---|---|---|")
        for name, s, took in rows:
            print(f"| {name} | {s * 1e6:.1f} | {'' if took is None else f'{took * 1e3:.2f}'} |")
    sdp.shutdown()


if __name__ == "__main__":
    main()
