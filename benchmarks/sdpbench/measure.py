"""sdp's own measurements for ``benchmarks/allreduce.py``: the size table's allreduce into a
preallocated output, the gradient list (100 x 256 KB) fused and unfused, interleaved, and the
memory floor of a shared-memory allreduce of that list (``CopyTimer``)."""
import dataclasses
import time

import numpy as np

import sdp
from sdpbench.common import collectives_done, time_calls

GRAD_COUNT, GRAD_BYTES = 100, 256 * 1024
GRAD_WARMUP = 10  # untimed gradient lists before the gradient-list table (the first 5-10 fused lists ran ~15% slower)
GRAD_ROUNDS = 5  # the gradient-list modes run interleaved, in this many rounds
GRAD_WARMUP_SWITCH = 3  # untimed lists after each switch of mode


def time_allreduce(buf: np.ndarray, iters: int, warmup: int, target_s: float, name: str = "bench"):
    """Per-iteration wall times of ``sdp.allreduce(buf, SUM, out=preallocated)`` on this rank (same
    iteration count on every rank: planned from the slowest rank's last warm-up iteration).  The
    result goes into a preallocated array, as nccl-tests does, so the figure is the collective and
    not the page faults of a fresh 64 MB allocation (glibc maps every array > 32 MB anew)."""
    out = np.empty_like(buf)
    return time_calls(lambda: sdp.allreduce(buf, name=name, op=sdp.Sum, out=out), iters, warmup, target_s, name)


def time_grad_list(grads, mode: str, iters: int):
    """Time one gradient list: 'async' submits all (one ``allreduce_async`` each) then waits all;
    'grouped' submits all in one batch (``grouped_allreduce_async``); 'sequential' waits each."""
    times = []
    colls = []
    sdp.barrier()
    for _ in range(iters):
        c0 = collectives_done()
        t0 = time.perf_counter()
        if mode == "async":
            hs = [sdp.allreduce_async(g, name=f"grad.{i}", op=sdp.Sum) for i, g in enumerate(grads)]
            for h in hs:
                h.wait()
        elif mode == "grouped":
            hs = sdp.api.grouped_allreduce_async(grads, names=[f"grad.{i}" for i in range(len(grads))],
                                             op=sdp.Sum)
            for h in hs:
                h.wait()
        else:
            for i, g in enumerate(grads):
                sdp.allreduce(g, name=f"grad.{i}", op=sdp.Sum)
        times.append(time.perf_counter() - t0)
        colls.append(collectives_done() - c0)
    return times, colls


def measure_grad_modes(grads, iters: int, grouped: bool, rounds: int = GRAD_ROUNDS, copier=None):
    """Times of every gradient-list mode, interleaved: ``rounds`` rounds, each running every mode
    in turn (``iters / rounds`` lists of the fused modes, a third of that of the slow unfused
    ones, each after :data:`GRAD_WARMUP_SWITCH` untimed lists), so that a slow stretch of the
    machine hits every mode alike instead of one block.  Unfused = fusion threshold 0, set with
    ``set_fusion_threshold`` (rank 0's value plans every rank's buckets).  Returns
    ``{mode: (times, collectives per list)}``; modes: async, grouped, sequential, unfused, and
    "copy" (``copier.time_copy()`` once per round, when a :class:`CopyTimer` is given)."""
    threshold = sdp.api.fusion_threshold()
    modes = [("async", "async", threshold, 1), ("sequential", "sequential", threshold, 3),
             ("unfused", "async", 0, 3)]
    if grouped:
        modes.insert(1, ("grouped", "grouped", threshold, 1))
    per_round = max(1, -(-iters // rounds))
    out = {key: ([], []) for key, *_ in modes}
    for _ in range(rounds):
        for key, mode, fusion, div in modes:
            sdp.api.set_fusion_threshold(fusion)
            time_grad_list(grads, mode, GRAD_WARMUP_SWITCH)
            t, c = time_grad_list(grads, mode, max(1, per_round // div))
            out[key][0].extend(t)
            out[key][1].extend(c)
        if copier is not None:
            out.setdefault("copy", ([], []))[0].append(copier.time_copy())
    sdp.api.set_fusion_threshold(threshold)
    return out


class CopyTimer:
    """The memory floor of a shared-memory allreduce of ``nbytes``: :meth:`time_copy` times one
    ``np.copyto`` of ``nbytes`` out of cache while every rank copies at the same time (``copies``
    back to back after a barrier, alternating between two source/destination pairs that together
    exceed any cache).  Per rank the shared-memory path reads and writes ``2 * nbytes * (n-1)/n``
    packing the peers' chunks and ``2 * nbytes`` reducing its chunk and pushing it to every peer
    (see ``sdp.engine.collectives.allreduce_staged``): :attr:`copies_per_allreduce` =
    ``1 + (n-1)/n`` copies of ``nbytes``."""

    def __init__(self, nbytes: int, n: int, copies: int = 6):
        self.pairs = [(np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)) for _ in range(2)]
        for src, dst in self.pairs:
            np.copyto(dst, src)  # first touch, outside the timing
        self.copies, self.copies_per_allreduce = copies, 1 + (n - 1) / n

    def time_copy(self) -> float:
        sdp.barrier()
        t0 = time.perf_counter()
        for k in range(self.copies):
            np.copyto(self.pairs[k % 2][1], self.pairs[k % 2][0])
        return (time.perf_counter() - t0) / self.copies


@dataclasses.dataclass
class Row:
    nbytes: int
    count: int
    iters: int
    t: float            # median seconds, max over ranks
    tf_t: float = None  # TF baseline median (2 workers), max over workers
    hvd_t: float = None
