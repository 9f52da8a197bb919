"""What numpy's BLAS threads cost a small collective when several ranks share a host (issue 30).

    sdprun -np 2 python benchmarks/blas_threads.py            # ~20 s

A training step as numpy code meets a collective: ``--work-ms`` of matrix products
(``np.dot`` of two ``--n`` x ``--n`` float32 matrices, OpenBLAS), then a 1 KB allreduce, timed
from the last rank's start to the last rank's result (as ``latency.isolated``).  Rounds alternate
between BLAS as :func:`sdp.init` leaves it (at most this rank's share of the cores,
:mod:`sdp.common.blas_threads`) and BLAS with one thread per core (its default), set with
threadpoolctl, and rank 0 prints the median allreduce time and the median time of one product
(the compute side) of each.
"""
import argparse
import os
import statistics
import time

import numpy as np
from threadpoolctl import threadpool_limits

import sdp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--work-ms", type=float, default=1.0)
    p.add_argument("--n", type=int, default=300)
    args = p.parse_args()
    sdp.init()
    cores = len(os.sched_getaffinity(0))
    a = np.ones((args.n, args.n), np.float32)
    buf, out = np.ones(256, np.float32), np.empty(256, np.float32)
    res = {"share": ([], []), "all cores": ([], [])}
    for r in range(args.rounds):
        for mode in res:
            with threadpool_limits(limits=None if mode == "share" else cores, user_api="blas"):
                spans, dots = np.zeros((args.iters, 2)), []
                for i in range(args.iters + 5):
                    sdp.barrier()
                    end = time.perf_counter() + args.work_ms / 1e3
                    while time.perf_counter() < end:
                        t = time.perf_counter()
                        np.dot(a, a)
                        dots.append(time.perf_counter() - t)
                    t0 = time.perf_counter()
                    sdp.allreduce(buf, name="blas.1k", op=sdp.Sum, out=out)
                    if i >= 5:
                        spans[i - 5] = (t0, time.perf_counter())
            every = sdp.allgather(spans.reshape(1, -1), name="blas.spans").reshape(sdp.size(), args.iters, 2)
            res[mode][0].append(float(np.median(every[:, :, 1].max(0) - every[:, :, 0].max(0))))
            res[mode][1].append(float(sdp.allreduce(np.array([statistics.median(dots)]), name="blas.dot",
                                                    op=sdp.Max)[0]))
    if sdp.rank() == 0:
        from threadpoolctl import threadpool_info
        blas = [i for i in threadpool_info() if i["user_api"] == "blas"]
        print(f"ranks {sdp.size()}, local {sdp.local_size()}, cores {cores}; BLAS after init: "
              f"{[(i['internal_api'], i['num_threads']) for i in blas]}")
        print(f"{'BLAS threads':<14} {'1 KB allreduce after work (us)':>32} {'np.dot %dx%d (us)' % (args.n, args.n):>20}")
        for mode, (ar, dot) in res.items():
            print(f"{mode:<14} {statistics.median(ar) * 1e6:32.1f} {statistics.median(dot) * 1e6:20.1f}")
    sdp.shutdown()


if __name__ == "__main__":
    main()
