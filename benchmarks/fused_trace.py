"""Where one fused gradient list spends its time, on every rank: the critical path, in ms.

    sdprun -np 2 python benchmarks/fused_trace.py [--lists 100] [--count 100] [--kb 256]

Each rank submits ``--count`` tensors of ``--kb`` KB float32 with ``allreduce_async`` and waits
for all of them, ``--lists`` times after 20 untimed lists (the response and batch caches are warm,
as in a training step).  The engine's steps are wrapped with time stamps (CLOCK_MONOTONIC, one
clock for every process on the host): taking the queue and sending the request, running the
response, packing the fusion bucket, and posting and waiting at each barrier of the
shared-memory allreduce (entry and exit).  Rank 0 prints, per event, its median time since rank 0 started submitting the list,
sorted by time, so the gaps show what each part costs: e.g. a barrier wait's exit minus the later
of the ranks' posts is its latency.  A diagnostic: it wraps engine internals, so it follows them.
"""
import argparse
import collections
import statistics
import time

import numpy as np

import sdp
from sdp.engine import barrier, fusion
from sdp.engine import runtime as engine_runtime

EVENTS = []  # (label, time.monotonic())


def mark(label: str) -> None:
    EVENTS.append((label, time.monotonic()))


def wrap(owner, attr: str, label: str) -> None:
    """Stamp ``label>`` on entry to ``owner.attr`` and ``label<`` on exit."""
    inner = getattr(owner, attr)

    def stamped(*args, **kwargs):
        mark(label + ">")
        try:
            return inner(*args, **kwargs)
        finally:
            mark(label + "<")

    setattr(owner, attr, stamped)


def one_list(grads):
    mark("submit>")
    handles = [sdp.allreduce_async(g, name=f"grad.{i}", op=sdp.Sum) for i, g in enumerate(grads)]
    mark("submit<")
    for h in handles:
        h.wait()
    mark("woken")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lists", type=int, default=100, help="timed gradient lists")
    p.add_argument("--count", type=int, default=100, help="tensors per list")
    p.add_argument("--kb", type=int, default=256, help="KB per tensor (float32)")
    args = p.parse_args(argv)
    wrap(fusion, "pack", "pack")
    wrap(barrier, "post", "barrier post")
    wrap(barrier, "wait", "barrier wait")
    wrap(engine_runtime.Runtime, "_send_requests", "request")
    wrap(engine_runtime.Runtime, "_execute", "run")
    sdp.init()
    grads = [np.random.default_rng(i).random(args.kb * 256, dtype=np.float32) for i in range(args.count)]
    for _ in range(20):
        one_list(grads)
    lists = []
    for _ in range(args.lists):
        sdp.barrier()
        time.sleep(0.002)  # let the barrier's own messages settle
        EVENTS.clear()
        one_list(grads)
        lists.append(list(EVENTS))
    every = sdp.allgather_object(lists, name="trace.events")
    if sdp.rank() == 0:
        report(every)
    sdp.shutdown()
    return 0


def report(every) -> None:
    """Median time of each (rank, event, occurrence) since rank 0's ``submit>`` of the same list."""
    rel = collections.defaultdict(list)
    for i in range(len(every[0])):
        t0 = next(t for label, t in every[0][i] if label == "submit>")
        for rank, lists in enumerate(every):
            seen = collections.Counter()
            for label, t in lists[i]:
                seen[label] += 1
                rel[(rank, label, seen[label])].append((t - t0) * 1e3)
    n = len(every[0])
    rows = sorted((statistics.median(v), k, len(v)) for k, v in rel.items() if len(v) >= n // 2)
    print(f"fused list trace: {len(every)} ranks, {n} lists; median ms since rank 0 began submitting")
    print(f"{'ms':>8}  {'rank':>4}  event")
    for ms, (rank, label, k), count in rows:
        print(f"{ms:8.3f}  {rank:>4}  {label}{'' if k == 1 else f' #{k}'}"
              f"{'' if count == n else f'  (in {count} of {n} lists)'}")
    for rank, lists in enumerate(every):
        own = [(next(t for label, t in ev if label == "woken") - next(t for label, t in ev if label == "submit>")) * 1e3
               for ev in lists]
        print(f"rank {rank}: list median {statistics.median(own):.3f} ms, min {min(own):.3f} ms")

if __name__ == "__main__":
    raise SystemExit(main())
