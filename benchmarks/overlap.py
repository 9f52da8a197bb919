"""How much of an allreduce hides behind computation on the caller's thread.

    sdprun -np 2 python benchmarks/overlap.py [--sizes 4M,64M] [--iters 10]
    SDP_SHM_SLAB_BYTES=0 sdprun -np 2 python benchmarks/overlap.py    # ZeroMQ only, as between hosts

The engine runs collectives on its own thread, and numpy, BLAS and ZeroMQ release the GIL, so a
framework can keep computing while gradients travel (``horovod.tensorflow``'s design; issue 3,
item 1).  Per size, every rank measures the median of ``--iters`` runs of:

* ``compute``: a fixed amount of single-threaded BLAS work (float32 256x256 matmuls, sized to
  take about as long as the allreduce alone);
* ``allreduce``: ``allreduce_async`` + ``wait`` of that many bytes (float32 SUM);
* ``both``: ``allreduce_async``, then the same compute, then ``wait``.

``hidden = (compute + allreduce - both) / min(compute, allreduce)``: 100% when the shorter one
is entirely hidden, 0% when they run one after the other.  Rank 0 prints the maximum over ranks
of each time (ms).  On a machine with fewer cores than ranks x 2 the threads share cores, so
expect less hiding there than on a training host.
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one core of compute per rank, before numpy loads BLAS
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import sdp  # noqa: E402
from sdpbench.common import parse_size  # noqa: E402  (benchmarks/sdpbench/: the benchmarks' shared helpers)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4M,64M", help="allreduce sizes in bytes (K/M/G suffixes)")
    p.add_argument("--iters", type=int, default=10, help="timed runs per measurement")
    args = p.parse_args(argv)
    sdp.init()
    a = np.random.default_rng(sdp.rank()).random((256, 256), dtype=np.float32)
    out = np.empty_like(a)

    def compute(k):
        for _ in range(k):
            np.matmul(a, a, out=out)

    def timed(fn):
        runs = []
        for _ in range(args.iters):
            sdp.barrier()
            t = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t)
        return max(sdp.allgather_object(statistics.median(runs) * 1e3, name=f"ovl.{next(ids)}"))

    ids = iter(range(1 << 30))
    rows = []
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        buf = np.ones(size // 4, np.float32)
        names = iter(range(1 << 30))

        def reduce_only():
            sdp.allreduce_async(buf, name=f"ovl.{size}.{next(names)}", op=sdp.Sum).wait()

        t_ar = timed(reduce_only)
        t = time.perf_counter()
        compute(20)
        per = (time.perf_counter() - t) / 20
        k = max(1, int(round(sdp.allreduce(np.array([t_ar / 1e3 / per]), name=f"ovl.k.{size}", op=sdp.Min)[0])))
        t_c = timed(lambda: compute(k))

        def both():
            h = sdp.allreduce_async(buf, name=f"ovl.{size}.{next(names)}", op=sdp.Sum)
            compute(k)
            h.wait()

        t_both = timed(both)
        rows.append((size, t_c, t_ar, t_both, (t_c + t_ar - t_both) / min(t_c, t_ar)))
    if sdp.rank() == 0:
        print(f"overlap of allreduce (float32 SUM) with BLAS work on the calling thread, {sdp.size()} ranks, "
              f"{os.cpu_count()} cores, shared memory slab {os.environ.get('SDP_SHM_SLAB_BYTES', 'default')}; "
              "ms = median over runs, max over ranks")
        print(f"{'size(B)':>12} {'compute':>10} {'allreduce':>10} {'both':>10} {'serial':>10} {'hidden':>8}")
        for size, t_c, t_ar, t_both, hidden in rows:
            print(f"{size:>12} {t_c:>10.2f} {t_ar:>10.2f} {t_both:>10.2f} {t_c + t_ar:>10.2f} {100 * hidden:>7.0f}%")
    sdp.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
