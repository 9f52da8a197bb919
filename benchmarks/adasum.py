"""Adasum against Average (issue 54): the same float32 buffer through ``sdp.allreduce`` with
``op=Average`` and with ``op=Adasum``, in alternating rounds of one job.

Run under the launcher::

    sdprun -np 2 python benchmarks/adasum.py
    sdprun -np 4 python benchmarks/adasum.py --sizes 1M,64M

Prints (rank 0) an environment line, then per size and op the median time (per-rank medians over
every round, then the maximum over ranks), algbw = bytes / time and busbw = algbw * 2(n-1)/n (the
nccl-tests definitions, GB/s = 1e9 B/s, applied to both ops for comparison), and Adasum's time
over Average's.  Average takes sdp's fastest path for the call (on one host, up to 1 MB between
2 ranks, the fast lane in the calling thread; above, shared memory); Adasum always takes the
engine thread and the point-to-point exchange of :mod:`sdp.engine.adasum`.
"""
import argparse
import os
import platform
import statistics
import time

import numpy as np

import sdp

OPS = (("Average", sdp.Average), ("Adasum", sdp.Adasum))


def parse_size(text: str) -> int:
    t = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1M,64M", help="message sizes (default 1M,64M)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds of both ops (default 5)")
    p.add_argument("--target-s", type=float, default=0.5, help="seconds per op, size and round (default 0.5)")
    args = p.parse_args()
    sdp.init()
    n, r = sdp.size(), sdp.rank()
    if r == 0:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"env: host={platform.node()} cores={os.cpu_count()} load=[{load}] numpy={np.__version__} "
              f"world_size={n} dtype=float32 rounds={args.rounds}", flush=True)
        print(f"{'size':>6} {'op':>8} {'median us':>12} {'algbw':>8} {'busbw':>8}  Adasum/Average", flush=True)
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        buf = np.random.default_rng(r).standard_normal(size // 4).astype(np.float32)
        times = {name: [] for name, _ in OPS}
        iters = {}
        for name, op in OPS:  # warm-up, and the iterations that fit in --target-s (rank 0's estimate)
            t0 = time.perf_counter()
            for _ in range(2):
                sdp.allreduce(buf, name=f"{name}.{size}", op=op)
            est = (time.perf_counter() - t0) / 2
            iters[name] = int(sdp.broadcast(np.array([max(2, min(200, args.target_s / max(est, 1e-6)))], np.int64),
                                            0, name=f"iters.{name}.{size}")[0])
        for _ in range(args.rounds):
            for name, op in OPS:
                for _ in range(iters[name]):
                    t0 = time.perf_counter()
                    sdp.allreduce(buf, name=f"{name}.{size}", op=op)
                    times[name].append(time.perf_counter() - t0)
        medians = {name: float(sdp.allreduce(np.array([statistics.median(t)]), name=f"median.{name}.{size}",
                                             op=sdp.Max)[0]) for name, t in times.items()}
        if r == 0:
            for name, _ in OPS:
                t = medians[name]
                algbw = size / t / 1e9
                ratio = f"{medians['Adasum'] / medians['Average']:.2f}x" if name == "Adasum" else ""
                label = f"{size >> 20}M" if size >= 1 << 20 else f"{size >> 10}K"
                print(f"{label:>6} {name:>8} {t * 1e6:12.1f} {algbw:8.3f} {algbw * 2 * (n - 1) / n:8.3f}  {ratio}",
                      flush=True)
    if r == 0:
        print(f"load at end [{' '.join(f'{x:.2f}' for x in os.getloadavg())}]", flush=True)
    sdp.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
