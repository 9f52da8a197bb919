"""Soak: does a long loop of collectives hold memory, file descriptors and /dev/shm flat?

    sdprun -np 2 python benchmarks/soak.py [--steps 20000] [--every 1000] [--warmup 2000]

Issue 17's acceptance check (a run, not a test).  Every step makes one collective call through
:mod:`sdp.api`, its kind and size drawn from a random generator seeded alike on every rank (so the
ranks agree on shapes), mixing:

* ``allreduce`` (SUM, float32), ``allgather`` (each rank contributes rank + 1 rows) and
  ``broadcast`` (root alternates), each with a name from a pool of ``--names`` names (the same
  name comes back with other sizes, as gradients of a model with dynamic shapes would) or unnamed
  (auto names, which come back after ``--auto-names`` calls: it sets ``sdp.api.AUTO_NAMES``,
  1024 by default, so that every name is in use within the warm-up);
* fused lists: ``grouped_allreduce`` of 2-8 arrays, and as many ``allreduce_async`` calls
  followed by a wait on all of them, named or not.

The engine's response caches hold one entry per tensor name, so they grow until every name has
been seen and then stay put; the ``cache`` column (this rank's entries, plus rank 0's coordinator)
shows when that is.

Sizes are log-uniform between 4 B and ``--max-kb`` KB, so the small-message path and the
shared-memory result pool both get traffic.  Every result is checked (SUM of ``rank + 1`` over
the ranks, rank order of allgather, the root's value of broadcast); a wrong one stops the run.

Every ``--every`` steps each rank samples, with psutil: resident memory (RSS, MiB, which includes
the shared-memory pages this rank has touched), open file descriptors, and the resident
``/dev/shm`` mappings of the process (MiB; the segment files are unlinked once mapped, so they are
counted from the mappings) together with the number of this job's files still in ``/dev/shm``.
Rank 0 prints one row per sample with every rank's values (the sample itself is gathered by one
more allgather).  The verdict compares every sample after ``--warmup`` steps with the one at
``--warmup``: flat when no rank's RSS grew by more than ``--rss-slack-mib`` (16) MiB, its fd count
never changed, nor the number of the job's files in /dev/shm (the segments are fixed in size;
pool pages touched for the first time still add to the mapped MiB, which RSS counts).  A NOT flat
verdict does not change the exit status (as for the other benchmarks).
"""
import argparse
import os
import sys
import time

import numpy as np
import psutil

import sdp
from sdp import api

KINDS = ("allreduce", "allgather", "broadcast", "grouped_allreduce", "async_list")
MIB = 1 << 20


def sample(proc: psutil.Process, job: str) -> np.ndarray:
    """[RSS MiB, open fds, resident /dev/shm mappings MiB, this job's files in /dev/shm, response
    cache entries (this rank's + rank 0's coordinator's; engine internals, for the reader)]."""
    shm = sum(m.rss for m in proc.memory_maps(grouped=True) if m.path.startswith("/dev/shm/"))
    files = sum(1 for f in os.listdir("/dev/shm") if f.startswith(f"sdp-{job}-")) if job else -1
    rt = api.runtime()
    cache = len(rt._cache) + (len(rt._coord.cache_meta) if rt._coord is not None else 0)
    return np.array([proc.memory_info().rss / MIB, proc.num_fds(), shm / MIB, files, cache], np.float64)


def count(rng: np.random.Generator, max_bytes: int) -> int:
    """Number of float32 elements, log-uniform between 1 and max_bytes / 4."""
    return max(1, int(np.exp(rng.uniform(0.0, np.log(max_bytes / 4)))))


def step(rng: np.random.Generator, i: int, me: int, n: int, args) -> None:
    kind = KINDS[rng.integers(len(KINDS))]
    named = rng.random() < 0.5
    name = f"soak.{kind}.{rng.integers(args.names)}" if named else None
    expect = np.float32(n * (n + 1) / 2)  # SUM over ranks of rank + 1
    if kind == "allreduce":
        out = api.allreduce(np.full(count(rng, args.max_bytes), me + 1, np.float32), name=name, op=sdp.Sum)
        ok = out[0] == expect and out[-1] == expect
    elif kind == "allgather":
        cols = count(rng, args.max_bytes // n)
        out = api.allgather(np.full((me + 1, cols), me, np.int32), name=name)
        ok = out.shape == (n * (n + 1) // 2, cols) and out[0, 0] == 0 and out[-1, -1] == n - 1
    elif kind == "broadcast":
        root = i % n
        out = api.broadcast(np.full(count(rng, args.max_bytes), me * 10 + 1, np.float32), root, name=name)
        ok = out[0] == root * 10 + 1 and out[-1] == root * 10 + 1
    else:
        sizes = [count(rng, args.max_bytes) for _ in range(rng.integers(2, 9))]
        arrays = [np.full(s, me + 1, np.float32) for s in sizes]
        if kind == "grouped_allreduce":
            outs = api.grouped_allreduce(arrays, name=name, op=sdp.Sum)
        else:
            names = [f"{name}.{j}" if name else None for j in range(len(arrays))]
            handles = [api.allreduce_async(a, name=nm, op=sdp.Sum) for a, nm in zip(arrays, names)]
            outs = [h.wait() for h in handles]
        ok = all(o[0] == expect and o[-1] == expect for o in outs)
    if not ok:
        raise SystemExit(f"rank {me}: step {i}: wrong result of {kind} {name or '(unnamed)'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20000, help="collective calls per rank")
    p.add_argument("--every", type=int, default=1000, help="sample every this many steps")
    p.add_argument("--warmup", type=int, default=2000, help="the sample the later ones are compared with")
    p.add_argument("--names", type=int, default=64, help="pool of names for the named calls")
    p.add_argument("--auto-names", type=int, default=128, help="sdp.api.AUTO_NAMES: distinct auto names per kind")
    p.add_argument("--max-kb", type=int, default=256, help="largest array in KB")
    p.add_argument("--rss-slack-mib", type=float, default=16.0, help="RSS growth still called flat")
    p.add_argument("--seed", type=int, default=17)
    args = p.parse_args(argv)
    args.max_bytes = args.max_kb << 10
    api.AUTO_NAMES = args.auto_names
    api.init()
    me, n = api.rank(), api.size()
    job = os.environ.get("SDP_JOB_ID", "")
    proc = psutil.Process()
    rng = np.random.default_rng(args.seed)  # same draws on every rank
    rows = []  # (step, seconds, per-rank samples n x 5)
    if me == 0:
        cols = "RSS MiB, fds, /dev/shm MiB, files, cache"
        print(f"{'step':>6} {'s':>7}  " + "  ".join(f"rank {r}: {cols}" for r in range(n)), flush=True)
    t0 = time.monotonic()
    for i in range(1, args.steps + 1):
        step(rng, i, me, n, args)
        if i % args.every == 0:
            rows.append((i, time.monotonic() - t0, api.allgather(sample(proc, job)[None], name="soak.sample")))
            if me == 0:
                print(f"{i:>6} {rows[-1][1]:7.1f}  " + "  ".join(
                    f"{r[0]:7.1f} {int(r[1]):4d} {r[2]:6.1f} {int(r[3]):3d} {int(r[4]):5d}" for r in rows[-1][2]),
                    flush=True)
    base = [r for r in rows if r[0] == args.warmup]
    if me == 0 and base:
        ref, later = base[0][2], [r[2] for r in rows if r[0] > args.warmup]
        growth = max((s[:, 0] - ref[:, 0]).max() for s in later) if later else 0.0
        fds_same = all((s[:, 1] == ref[:, 1]).all() for s in later)
        shm_grew = max((s[:, 2] - ref[:, 2]).max() for s in later) if later else 0.0
        files_same = all((s[:, 3] == ref[:, 3]).all() for s in later)
        flat = growth <= args.rss_slack_mib and fds_same and files_same
        print(f"verdict: {'flat' if flat else 'NOT flat'} after warm-up ({args.warmup} steps, {n} ranks, "
              f"{args.steps} steps in {rows[-1][1]:.0f} s): RSS growth at most {growth:+.1f} MiB "
              f"(limit {args.rss_slack_mib:g}), fds {'unchanged' if fds_same else 'CHANGED'}, "
              f"/dev/shm files {'unchanged' if files_same else 'CHANGED'}, mapped {shm_grew:+.1f} MiB (pool pages "
              "touched for the first time; counted in RSS)", flush=True)
    api.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
