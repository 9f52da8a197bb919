"""Worker functions for the fast lane (sdp.engine.lane), run inside real rank processes: how
collectives flow through it (per-rank orders, ranks far ahead or late, bursts and their
batches, groups, joins, mismatches and a killed rank, synchronous calls beside the engine,
threads).  The arithmetic is ``workers_lane``'s, the compiled entries ``workers_lane_front``'s."""
import os
import random

import numpy as np

import sdp
from sdp.common.reduce_ops import ReduceOp
from workers_lane import BF16, _counting, _never_escalate


def orders(steps):
    """Small allreduces submitted asynchronously in a per-rank random order, mixed with a large
    allreduce, a broadcast and an allgather, step after step; returns (all exact, lane counts)."""
    n, r = sdp.size(), sdp.rank()
    rng = random.Random(r)
    ok = True
    for step in range(steps):
        names = [f"s{i}" for i in range(12)] + ["big", "bc", "ag"]
        rng.shuffle(names)
        hs = {}
        for name in names:
            if name == "big":
                hs[name] = sdp.allreduce_async(np.full(300_000, float(step + r), np.float32), name=name, op=sdp.Sum)
            elif name == "bc":
                hs[name] = sdp.broadcast_async(np.full(4, float(r + 7)), root_rank=1, name=name)
            elif name == "ag":
                hs[name] = sdp.allgather_async(np.full((1, 2), r, np.int32), name=name)
            else:
                i = int(name[1:])  # (odd sizes: copies padded to 64 bytes in the data ring)
                hs[name] = sdp.allreduce_async(np.full(3 + 7 * i, float(step * r + i), np.float32 if i % 2 else np.float64),
                                               name=name, op=sdp.Sum)
        for name, h in hs.items():
            got = h.wait()
            if name == "big":
                ok = ok and bool(np.all(got == sum(step + q for q in range(n))))
            elif name == "bc":
                ok = ok and bool(np.all(got == 8.0))
            elif name == "ag":
                ok = ok and got.tolist() == [[q, q] for q in range(n)]
            else:
                ok = ok and bool(np.all(got == sum(step * q + int(name[1:]) for q in range(n))))
    return [ok, sdp.api.runtime().lane.counts]


def broadcasts():
    """Broadcasts of every kind of array from root 1 (strings, bool, bfloat16, a 0-d array) and
    broadcast_object (two broadcasts); returns (all exact, lane counts)."""
    r = sdp.rank()
    cases = [np.array(["ab", "c"]), np.array([True, False, True]), np.arange(7, dtype=np.int64).reshape(7, 1),
             np.array(3.5), np.arange(1000, dtype=np.float32)] + [np.arange(5).astype(d) for d in BF16]
    ok = True
    for i, want in enumerate(cases):
        mine = want if r == 1 else np.zeros_like(want)
        got = sdp.broadcast(mine, root_rank=1, name=f"bc{i}")
        ok = ok and got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    obj = sdp.broadcast_object({"from": r, "list": [1, 2]} if r == 1 else None, root_rank=1, name="obj")
    return [ok and obj == {"from": 1, "list": [1, 2]}, sdp.api.runtime().lane.counts]


def far_ahead(count, late_s):
    """Rank 0 submits 24 allreduces of 256 KB (more than its data ring holds) and ``count`` small
    ones (more than the lane's DEPTH) without waiting; the other ranks start ``late_s`` later.  Returns
    (all exact, lane counts)."""
    import time
    n, r = sdp.size(), sdp.rank()
    if r:
        time.sleep(late_s)  # (the scenario: a late rank, not a wait for an event)
    big = [sdp.allreduce_async(np.full(65536, float(i * r), np.float32), name=f"b{i}", op=sdp.Sum) for i in range(24)]
    hs = [sdp.allreduce_async(np.full(32, float(i + r), np.float32), name=f"f{i}", op=sdp.Sum) for i in range(count)]
    ok = all(bool(np.all(h.wait() == sum(i + q for q in range(n)))) for i, h in enumerate(hs))
    ok = ok and all(bool(np.all(h.wait() == sum(i * q for q in range(n)))) for i, h in enumerate(big))
    return [ok, sdp.api.runtime().lane.counts]


def joined(rounds, epochs=1):
    """``epochs`` times: the last rank joins at once; the others run ``rounds`` allreduces (the
    joined rank adds zeros), then join; then every rank runs 20 allreduces.  Returns (the first
    epoch's results, its join's last rank, the allreduces after each join exact, the lane is
    off, the lane's FAST count after each join's 20 allreduces minus before them)."""
    n, r = sdp.size(), sdp.rank()
    lane = sdp.api.runtime().lane
    got, lasts, after, fast = [], [], True, []
    for epoch in range(epochs):
        if r != n - 1:
            for i in range(rounds + epoch):  # (each epoch leaves the ranks' positions further apart)
                y = float(sdp.allreduce(np.full(3, 1.0 + i), name=f"j{i}", op=sdp.Sum)[0])
                if epoch == 0:
                    got.append(y)
        lasts.append(sdp.join())
        before = lane.counts["fast"]
        for i in range(20):
            after = after and float(sdp.allreduce(np.full(2, float(i + r)), name="after", op=sdp.Sum)[0]) == \
                sum(i + q for q in range(n))
        fast.append(lane.counts["fast"] - before)
    return [got, lasts[0], after, lane.off, fast]


def mismatch():
    """One name, other shapes on each rank: the lane gives it to the engine, which names them."""
    r = sdp.rank()
    try:
        sdp.allreduce(np.ones(2 + r, np.float32), name="shape_case", op=sdp.Sum)
    except sdp.errors.TensorMismatchError as e:
        return [str(e), sdp.api.runtime().lane.counts]
    return ["no error", sdp.api.runtime().lane.counts]


def killed_while_waiting():
    """Rank 1 dies while rank 0 waits on a lane allreduce rank 1 never posts; returns the error
    rank 0 sees and the seconds it took."""
    import time
    r = sdp.rank()
    sdp.allreduce(np.ones(4), name="warm", op=sdp.Sum)
    if r == 1:
        os._exit(3)
    t = time.monotonic()
    try:
        sdp.allreduce(np.ones(4), name="orphan", op=sdp.Sum)
    except sdp.errors.SdpError as e:
        return [type(e).__name__, str(e)[:200], time.monotonic() - t]
    return ["no error", "", time.monotonic() - t]


def bursts(steps):
    """``steps`` training-like steps of 40 small allreduces submitted one by one, asynchronously
    (a burst), then waited, the last step with bad calls in the middle of its burst (while a batch
    is open); then the burst's first name alone, synchronously, 5 times.  Returns (all exact, lane
    counts after the bursts, lane counts at the end, how many calls joined the open batch through
    ``Runtime.burst``, the bad calls' errors)."""
    n, r = sdp.size(), sdp.rank()
    joined = _counting(sdp.api.runtime(), "burst")
    ok, bad = True, []
    for step in range(steps):
        hs = []
        for i in range(40):
            hs.append(sdp.allreduce_async(np.full(64, float(step * r + i), np.float32), name=f"burst{i}", op=sdp.Sum))
            if step == steps - 1 and i == 20:
                for call in (lambda: sdp.allreduce_async(np.array(["x"] * 64), name="bad.dtype", op=sdp.Sum),
                             lambda: sdp.allreduce_async(np.ones(64, np.float32), name="bad.out", op=sdp.Sum,
                                                         out=np.empty(63, np.float32))):
                    try:
                        call()
                        bad.append("no error")
                    except (ValueError, TypeError) as e:
                        bad.append(f"{type(e).__name__}: {e}")
        ok = ok and all(h.name == f"burst{i}" and bool(np.all(h.wait() == sum(step * q + i for q in range(n))))
                        for i, h in enumerate(hs))  # (the compiled burst makes its handles itself)
    after_bursts = dict(sdp.api.runtime().lane.counts)
    for i in range(5):
        ok = ok and bool(np.all(sdp.allreduce(np.full(8, float(r + i)), name="burst0", op=sdp.Sum)
                                == sum(q + i for q in range(n))))
    return [ok, after_bursts, sdp.api.runtime().lane.counts, joined[0], bad]


def join_after_burst(count):
    """Every rank submits ``count`` small allreduces without waiting; the last rank then joins at
    once, the others wait theirs, run 3 more (the joined rank adds zeros) and join; then one
    more by all, and 4 more.  Returns (the burst and the 4 exact, the 3 results, the one after the
    join, the lane is off, how many of the last 5 the lane ran)."""
    n, r = sdp.size(), sdp.rank()
    hs = [sdp.allreduce_async(np.full(16, float(i + r), np.float32), name=f"jb{i}", op=sdp.Sum) for i in range(count)]
    more = []
    if r == n - 1:
        sdp.join()
    ok = all(bool(np.all(h.wait() == sum(i + q for q in range(n)))) for i, h in enumerate(hs))
    if r != n - 1:
        more = [float(sdp.allreduce(np.full(4, 1.0), name=f"jm{i}", op=sdp.Sum)[0]) for i in range(3)]
        sdp.join()
    fast = sdp.api.runtime().lane.counts["fast"]
    after = float(sdp.allreduce(np.ones(2), name="after", op=sdp.Sum)[0])
    for i in range(4):
        ok = ok and float(sdp.allreduce(np.full(2, float(i)), name="after", op=sdp.Sum)[0]) == n * i
    return [ok, more, after, sdp.api.runtime().lane.off, sdp.api.runtime().lane.counts["fast"] - fast]


def groups(rounds):
    """``grouped_allreduce`` of small arrays of many shapes (scalars, empty, sizes that need
    padding, 2-D), ``rounds`` times: float32 alone (packed straight into the lane's shared
    memory), then float32 and int64 (two requests in one submission: a burst, which the engine
    takes, packing each into its own buffer); inputs changed after each call must not change
    the next results.  Then a group with other shapes on the last rank (the same total): the
    lane hands it to the engine, which names the shapes.  Returns (all exact and aligned, the
    mismatch's message, lane counts)."""
    n, r = sdp.size(), sdp.rank()
    shapes = [(), (0,), (3,), (5, 7), (16,), (1, 1), (33,)]

    def data(q, k, ints):
        return ([np.full(s, q + i + k, np.float32) for i, s in enumerate(shapes)]
                + [np.full(s, q * 10 - i - k, np.int64) for i, s in enumerate(shapes[2:5]) if ints])

    ok = True
    for k in range(2 * rounds):
        mine = data(r, k, k % 2)
        got = sdp.grouped_allreduce(mine, name=f"grp{k % 2}", op=sdp.Sum)
        for a in mine:
            a.fill(-99)  # (the next round's results must not see this)
        want = [sum(arrays) for arrays in zip(*[data(q, k, k % 2) for q in range(n)])]
        ok = ok and all(g.shape == w.shape and g.dtype == w.dtype and np.array_equal(g, w) for g, w in zip(got, want))
        ok = ok and all(g.ctypes.data % 64 == 0 for g in got if g.size)
    bad = [np.ones((2, 3), np.float32), np.ones(4, np.float32)] if r != n - 1 else \
        [np.ones((3, 2), np.float32), np.ones(4, np.float32)]
    try:
        sdp.grouped_allreduce(bad, name="bad")
        msg = "no error"
    except sdp.errors.TensorMismatchError as e:
        msg = str(e)
    return [ok, msg, sdp.api.runtime().lane.counts]


def batches(steps):
    """``steps`` steps of a burst of small allreduces of several dtypes, ops, scales and
    ``out=`` arrays (several batches), waited at the end; on odd steps rank 0 waits in the middle
    of its burst, so its batches are cut otherwise than the other ranks' (the lane decides them
    SLOW and the engine runs them).  Returns (all exact, ``out=`` honoured, lane counts before
    the last step, lane counts at the end)."""
    n, r = sdp.size(), sdp.rank()
    lane = sdp.api.runtime().lane
    ok = same_out = True
    before = None
    for step in range(steps):
        if step == steps - 1:
            before = dict(lane.counts)
        outs = [np.empty(5, np.float64) for _ in range(3)]
        hs, want = [], []
        for i in range(12):
            x = np.full(7 + i, float(r + i + step), np.float32) if i != 3 else np.full(20, float(r + i + step),
                                                                                     np.float32)[::2]
            hs.append(sdp.allreduce_async(x, name=f"f{i}", op=sdp.Sum))  # (f3: not contiguous)
            want.append(np.full(7 + i, n * (i + step) + n * (n - 1) / 2, np.float32))
            if i == 5 and r == 0 and step % 2:
                hs[-1].wait()  # (rank 0 only: its float32 batch ends here)
        for i in range(3):
            hs.append(sdp.allreduce_async(np.full(5, float(r * i), np.float64), name=f"o{i}", op=sdp.Average,
                                          postscale_factor=2.0, out=outs[i]))
            want.append(np.full(5, float(i * (n - 1))))
        for i in range(4):
            hs.append(sdp.allreduce_async(np.full((2, 3), r + i, np.int32), name=f"i{i}", op=sdp.Max))
            want.append(np.full((2, 3), n - 1 + i, np.int32))
        hs.append(sdp.allreduce_async(np.full(4, 0.5 + r, np.float16), name="h", op=sdp.Sum))
        want.append(np.full(4, n * 0.5 + n * (n - 1) / 2, np.float16))
        for i in range(3):  # (an integer postscale: a request made as usual, after a batch of floats)
            hs.append(sdp.allreduce_async(np.full(3, float(r)), name=f"p{i}", op=sdp.Sum,
                                          postscale_factor=2 if i else 2.0))
            want.append(np.full(3, float(n * (n - 1))))
        got = [h.wait() for h in hs]
        ok = ok and all(g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w) for g, w in zip(got, want))
        same_out = same_out and all(got[12 + i] is outs[i] for i in range(3))
    return [ok, same_out, before, dict(lane.counts)]


def unwaited_batch(sleep_s):
    """Rank 0 submits small allreduces without waiting and sleeps ``sleep_s``; the other ranks
    wait for theirs.  Returns (exact, the seconds the others waited)."""
    import time
    n, r = sdp.size(), sdp.rank()
    sdp.barrier()
    t = time.monotonic()
    hs = [sdp.allreduce_async(np.full(3, float(r + i)), name=f"u{i}", op=sdp.Sum) for i in range(8)]
    if r == 0:
        time.sleep(sleep_s)  # (the scenario: a rank busy elsewhere, not a wait for an event)
    got = [h.wait() for h in hs]
    took = time.monotonic() - t
    return [all(bool(np.all(g == sum(q + i for q in range(n)))) for i, g in enumerate(got)), took]


def without_rank0(deadline_s, flag):
    """Rank 0 posts an allreduce, then holds its lane's lock (neither its caller nor its engine
    thread can decide anything) and creates the file ``flag``; the others then submit theirs and
    wait, while rank 0 waits until every other rank has consumed that position or ``deadline_s``
    passed.  Returns (exact, whether the others were done while rank 0 decided nothing, the lane
    counts of this allreduce)."""
    import time
    from sdp.engine import lane as lane_mod
    n, r = sdp.size(), sdp.rank()
    lane = sdp.api.runtime().lane
    sdp.barrier()
    sdp.allreduce(np.ones(4), name="w0", op=sdp.Sum)  # (the lane's records filled once)
    sdp.barrier()
    page, before = lane.page, dict(lane.counts)
    end = time.monotonic() + deadline_s
    if r == 0:
        p = lane._posted
        h = sdp.allreduce_async(np.full(5, 1.0), name="w1", op=sdp.Sum)
        with lane.lock:
            decided = page[0][lane_mod.DECIDED]
            open(flag, "w").close()
            while time.monotonic() < end and not all(page[q][lane_mod.DONE] > p for q in range(1, n)):
                time.sleep(0.001)
            early = all(page[q][lane_mod.DONE] > p for q in range(1, n)) and page[0][lane_mod.DECIDED] == decided
        got = h.wait()
    else:
        while not os.path.exists(flag) and time.monotonic() < end:
            time.sleep(0.001)
        got, early = sdp.allreduce(np.full(5, 1.0 + r), name="w1", op=sdp.Sum), None
    return [bool(np.all(got == sum(1.0 + q for q in range(n)))), early,
            {k: v - before[k] for k, v in lane.counts.items()}]


def grouped_steps(steps):
    """``steps`` grouped allreduces of 20 small tensors, each waited part by part as
    ``sdp.grouped_allreduce`` does (the group is often done before its first part is waited
    for).  Returns (exact, lane counts)."""
    _never_escalate()  # (a rank late on a busy machine is waited for)
    n, r = sdp.size(), sdp.rank()
    xs = [np.full(8 + i, float(r + i), np.float32) for i in range(20)]
    ok = True
    for _ in range(steps):
        got = sdp.grouped_allreduce(xs, name="steps", op=sdp.Sum)
        ok = ok and all(bool(np.all(g == sum(q + i for q in range(n)))) for i, g in enumerate(got))
    return [ok, sdp.api.runtime().lane.counts]


def burst_mismatch(count):
    """A burst of ``count`` small allreduces (gathered into a batch) in which the last rank gives
    "m3" another shape: the others complete exactly, "m3" raises the engine's mismatch on every
    rank.  Returns (the error's text, the others exact)."""
    n, r = sdp.size(), sdp.rank()
    sdp.barrier()
    hs = [sdp.allreduce_async(np.full(5 if (i == 3 and r == n - 1) else 4, float(r + i), np.float32),
                              name=f"m{i}", op=sdp.Sum) for i in range(count)]
    msg, ok = "no error", True
    for i, h in enumerate(hs):
        try:
            got = h.wait()
        except sdp.errors.TensorMismatchError as e:
            msg = str(e) if i == 3 else f"m{i}: {e}"
            continue
        ok = ok and bool(np.all(got == sum(q + i for q in range(n))))
    return [msg, ok]


def sync_large(rounds):
    """Synchronous allreduces up to ``lane.NOW_READ_BYTES`` x (size - 1) run in the lane (an
    asynchronous one stops at ``READ_BYTES``), larger ones in the engine: ``rounds`` of each size
    at the limit and just above it, then ``rounds`` asynchronous ones at the limit.  Returns (all
    exact, lane positions consumed FAST per size and for the asynchronous ones)."""
    from sdp.engine import lane as lanemod
    n, r = sdp.size(), sdp.rank()
    lane = sdp.api.runtime().lane
    at = lanemod.NOW_READ_BYTES // (n - 1) // 4  # (float32 elements)
    ok, fast = True, {}
    for count in (at, at + 16):
        before = lane.counts["fast"]
        for k in range(rounds):
            x = np.arange(count, dtype=np.float32) * (r + 1) + k
            got = sdp.allreduce(x, name=f"big{count}", op=sdp.Sum)
            want = np.arange(count, dtype=np.float32) * (n * (n + 1) // 2) + n * k
            ok = ok and got.dtype == np.float32 and np.array_equal(got, want)
        fast[count * 4] = lane.counts["fast"] - before
    before = lane.counts["fast"]
    for k in range(rounds):  # (asynchronous: over READ_BYTES, the engine's)
        got = sdp.allreduce_async(np.full(at, float(r + k), np.float32), name="big.async", op=sdp.Sum).wait()
        ok = ok and np.array_equal(got, np.full(at, float(n * (n - 1) // 2 + n * k), np.float32))
    fast["async"] = lane.counts["fast"] - before
    return [ok, fast]


def sync_beside_engine(steps):
    """Each step every rank submits a 4 MB allreduce (the engine's) and, while the engine thread
    runs it, a small synchronous ``sdp.allreduce``: waited at once, it is posted as itself (not
    gathered as a burst), so it stays in the lane.  Returns (all exact, lane counts of the steps)."""
    n, r = sdp.size(), sdp.rank()
    lane = sdp.api.runtime().lane
    sdp.allreduce(np.ones(1), name="warm", op=sdp.Sum)
    before, ok = dict(lane.counts), True
    for step in range(steps):
        big = sdp.allreduce_async(np.full(1 << 20, float(r + step), np.float32), name="big", op=sdp.Sum)
        small = sdp.allreduce(np.full(8, float(r * step)), name="small", op=sdp.Sum)
        ok = ok and bool(np.all(small == sum(q * step for q in range(n))))
        ok = ok and bool(np.all(big.wait() == sum(q + step for q in range(n))))
    return [ok, {k: v - before[k] for k, v in lane.counts.items()}]


def threaded_groups(steps):
    """Two threads per rank each submit their own group with ``grouped_allreduce_async`` and wait
    for it, ``steps`` times, concurrently (as TensorFlow's executor runs two buckets' submit ops):
    the ranks' threads reach the lane in any order, so a group may run whole in its caller, be
    held, or meet another group's position on a peer (SLOW: the engine).  Returns (all exact,
    lane counts)."""
    import threading
    n, r = sdp.size(), sdp.rank()
    shapes = [(3,), (2, 5), (100,), (7,)]
    ok = [True, True]

    def run(t):
        for k in range(steps):
            xs = [np.full(sh, float(r + k + t + j), np.float32) for j, sh in enumerate(shapes)]
            hs = sdp.api.grouped_allreduce_async(xs, [f"tg{t}.{j}" for j in range(len(shapes))], ReduceOp.SUM)
            for j, (h, sh) in enumerate(zip(hs, shapes)):
                got = h.wait()
                ok[t] &= got.shape == sh and bool(np.all(got == sum(q + k + t + j for q in range(n))))
    threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return [all(ok), dict(sdp.api.runtime().lane.counts)]
