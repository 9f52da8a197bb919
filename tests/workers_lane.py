"""Worker functions for the fast lane (sdp.engine.lane), run inside real rank processes."""
import hashlib
import os
import random

import numpy as np

import sdp
from sdp.common.reduce_ops import UFUNCS, ReduceOp, accumulation_dtype

try:
    import ml_dtypes
    BF16 = [ml_dtypes.bfloat16]
except ImportError:  # pragma: no cover - ml_dtypes comes with tensorflow
    BF16 = []
DTYPES = [np.float16, *BF16, np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8]
OPS = [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]


def _data(q, dtype, shape, seed):
    rng = np.random.default_rng(seed * 1000 + q)
    dt = np.dtype(dtype)
    if dt.kind == "f" or dt.name == "bfloat16":
        return rng.standard_normal(shape).astype(dt)
    return rng.integers(0 if dt.kind == "u" else -3, 4, shape).astype(dt)


def _expected(op, arrays, post, n):
    """Horovod's arithmetic: in rank order, 16-bit floats in float32 rounded once, the float
    factor (postscale, / n for AVERAGE) applied before rounding, integer AVERAGE floor-divided."""
    dtype = arrays[0].dtype
    acc = accumulation_dtype(dtype) or dtype
    t = arrays[0].astype(acc)
    for a in arrays[1:]:
        t = UFUNCS[op](t, a.astype(acc))
    t = np.array(t, dtype=acc)  # (a 0-d result comes back as a scalar)
    if dtype.kind in "iu":
        if op == ReduceOp.AVERAGE:
            t = t // n
        if post != 1.0:
            t = np.multiply(t, post, casting="unsafe").astype(dtype)
        return t.astype(dtype)
    factor = post / (n if op == ReduceOp.AVERAGE else 1)
    if factor != 1.0:
        t = np.multiply(t, factor, out=t, casting="unsafe")
    return t.astype(dtype)


def _counting(obj, attr: str) -> list:
    """Replace ``obj.attr`` (a callable that answers None for "not taken") with one that counts
    its other answers; returns the count (a one-element list)."""
    fn, count = getattr(obj, attr), [0]

    def counted(*a):
        got = fn(*a)
        count[0] += got is not None
        return got
    setattr(obj, attr, counted)
    return count


def _never_escalate():
    """No position of the lane is escalated to the engine on time from now on, on any rank: a
    rank late on a busy machine is waited for.  Every rank sets it before a barrier, so a rank
    slow to get here (importing, descheduled) cannot have its engine thread escalate a position
    its peers posted before it did (rank 0's thread decides with ``ESCALATE_S`` as it then was)."""
    import sdp.engine.lane_decide
    sdp.engine.lane_decide.ESCALATE_S = 3600.0
    sdp.barrier()  # (itself in the lane, where it may be escalated: not counted below)
    counts = sdp.api.runtime().lane.counts
    counts.update({k: 0 for k in counts})


def matrix(seed):
    """Every op x dtype x postscale, shapes from scalars to 64 KB, through the lane; returns
    (the cases that were not exact, a digest of every result, lane counts).  No position is
    escalated to the engine here (a rank late on a busy machine is waited for): the engine's
    arithmetic differs where it sends 16-bit partial sums between ranks (fewer elements than
    ranks, or across hosts, with 3 or more ranks; see sdp.engine.collectives.allreduce)."""
    _never_escalate()
    n, r = sdp.size(), sdp.rank()
    rng = random.Random(seed)
    bad, digest, cases = [], hashlib.sha256(), 0
    for dtype in DTYPES:
        for op in OPS:
            for post in (1.0, 0.5):
                if post != 1.0 and np.dtype(dtype).kind in "iu" and op != ReduceOp.SUM:
                    continue
                shape = rng.choice([(), (1,), (7, 3), (rng.randint(100, 16000 // np.dtype(dtype).itemsize),)])
                if op == ReduceOp.PRODUCT:
                    shape = (5,)
                s = rng.randint(1, 10**6)
                mine = _data(r, dtype, shape, s)
                got = sdp.allreduce(mine, name=f"m{cases}", op=op, postscale_factor=post)
                want = _expected(op, [_data(q, dtype, shape, s) for q in range(n)], post, n)
                cases += 1
                if got.shape != want.shape or got.dtype != want.dtype or got.tobytes() != want.tobytes():
                    bad.append([np.dtype(dtype).name, op.name, post, list(shape)])
                digest.update(got.tobytes())
    return [bad, digest.hexdigest(), cases, sdp.api.runtime().lane.counts]


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


def joined(rounds):
    """The last rank joins at once; the others run ``rounds`` allreduces (the joined rank adds
    zeros), then join.  Returns (results, the lane is off)."""
    n, r = sdp.size(), sdp.rank()
    got = []
    if r != n - 1:
        for i in range(rounds):
            got.append(float(sdp.allreduce(np.full(3, 1.0 + i), name=f"j{i}", op=sdp.Sum)[0]))
    last = sdp.join()
    after = float(sdp.allreduce(np.ones(2), name="after", op=sdp.Sum)[0])
    return [got, last, after, sdp.api.runtime().lane.off]


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
    more by all.  Returns (the burst exact, the 3 results, the last one, the lane is off)."""
    n, r = sdp.size(), sdp.rank()
    hs = [sdp.allreduce_async(np.full(16, float(i + r), np.float32), name=f"jb{i}", op=sdp.Sum) for i in range(count)]
    more = []
    if r == n - 1:
        sdp.join()
    ok = all(bool(np.all(h.wait() == sum(i + q for q in range(n)))) for i, h in enumerate(hs))
    if r != n - 1:
        more = [float(sdp.allreduce(np.full(4, 1.0), name=f"jm{i}", op=sdp.Sum)[0]) for i in range(3)]
        sdp.join()
    after = float(sdp.allreduce(np.ones(2), name="after", op=sdp.Sum)[0])
    return [ok, more, after, sdp.api.runtime().lane.off]


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


def sync_mixed(steps, seed):
    """``steps`` allreduces, each a synchronous ``sdp.allreduce`` on some ranks and
    ``allreduce_async(...).wait()`` on others (chosen per rank and step), of varied dtypes, ops,
    shapes and ``out=`` (a new array, another array, the input itself); a rank sometimes starts
    2 ms late (longer than the lane polls: the early ones then wait as held requests), and every
    10th step one rank passes a non-contiguous input.  Returns (the steps not exact, how many
    synchronous calls this rank made, how many of them made no Request at all: a Request is made
    for each name's first call and for each call not consumed while its caller polled, the lane
    counts)."""
    import time
    _never_escalate()  # (as in matrix: the engine's arithmetic differs for some cases)
    n, r = sdp.size(), sdp.rank()
    lane = sdp.api.runtime().lane
    made, make = [0], lane._request

    def counted(*a, **k):
        made[0] += 1
        return make(*a, **k)

    lane._request = counted
    rng = random.Random(seed)  # (the same choices on every rank; each rank reads its own)
    bad, syncs, free = [], 0, 0
    cases = [(np.float32, ReduceOp.SUM, 1.0), (np.float32, ReduceOp.AVERAGE, 1.0), (np.float16, ReduceOp.SUM, 0.5),
             (np.int32, ReduceOp.AVERAGE, 1.0), (np.float64, ReduceOp.MAX, 1.0)]
    sdp.allreduce(np.ones(1), name="warm", op=sdp.Sum)
    for step in range(steps):
        case, shape = rng.randrange(len(cases)), rng.choice([(), (3,), (4, 5), (300,)])
        dtype, op, post = cases[case]
        late, how, outs = rng.randrange(n + 3), [rng.randrange(2) for _ in range(n)], rng.randrange(3)
        strided = step % 10 == 9 and rng.randrange(n) == r
        mine = _data(r, dtype, shape, seed + step)
        want = _expected(op, [_data(q, dtype, shape, seed + step) for q in range(n)], post, n)
        if strided and mine.ndim == 1 and mine.size > 1:
            mine = np.repeat(mine, 2)[::2]
        out = None if outs == 0 else np.empty_like(mine) if outs == 1 or not mine.flags.c_contiguous else mine
        if late == r:
            time.sleep(0.002)  # (the scenario: a late rank)
        name = f"s{case}.{len(shape)}"  # (names come back, as a training step's do)
        if how[r]:
            syncs, before = syncs + 1, made[0]
            got = sdp.allreduce(mine, name=name, op=op, postscale_factor=post, out=out)
            free += made[0] == before
        else:
            got = sdp.allreduce_async(mine, name=name, op=op, postscale_factor=post, out=out).wait()
        if got.shape != want.shape or got.tobytes() != want.tobytes() or out is not None and got is not out:
            bad.append([step, np.dtype(dtype).name, op.name, list(shape), outs])
    return [bad, syncs, free, lane.counts]


def grouped_sync_mixed(steps, seed):
    """``steps`` grouped allreduces of 2-30 small arrays (one dtype each), ``sdp.grouped_allreduce``
    on some ranks and ``grouped_allreduce_async`` + a wait per array on others, a rank sometimes
    2 ms late.  Returns (the steps not exact, synchronous grouped calls this rank made, how many of
    them made no Request at all, the lane counts: as :func:`sync_mixed`)."""
    import time
    _never_escalate()  # (as in matrix)
    n, r = sdp.size(), sdp.rank()
    lane = sdp.api.runtime().lane
    made, group = [0], lane._request.group

    def counted(*a, **k):
        made[0] += 1
        return group(*a, **k)

    lane._request = type("Counted", (), {"group": staticmethod(counted), "__call__": None})
    rng = random.Random(seed)
    cases = [(np.float32, ReduceOp.SUM, 1.0), (np.float64, ReduceOp.AVERAGE, 1.0), (np.int32, ReduceOp.SUM, 1.0),
             (np.float16, ReduceOp.AVERAGE, 0.5)]
    bad, calls, free = [], 0, 0
    shapes = [[rng.choice([(), (1,), (5,), (3, 4), (100,)]) for _ in range(rng.randrange(2, 31))] for _ in range(4)]
    for step in range(steps):
        case, k = rng.randrange(len(cases)), rng.randrange(len(shapes))
        dtype, op, post = cases[case]
        late, sync = rng.randrange(n + 3), [rng.randrange(2) for _ in range(n)]
        mine = [_data(r, dtype, sh, seed + step * 100 + j) for j, sh in enumerate(shapes[k])]
        want = [_expected(op, [_data(q, dtype, sh, seed + step * 100 + j) for q in range(n)], post, n)
                for j, sh in enumerate(shapes[k])]
        if late == r:
            time.sleep(0.002)  # (the scenario: a late rank)
        name = f"g{case}.{k}"
        if sync[r]:
            calls, before = calls + 1, made[0]
            got = sdp.grouped_allreduce(mine, name=name, op=op, postscale_factor=post)
            free += made[0] == before
        else:
            got = [h.wait() for h in sdp.grouped_allreduce_async(mine, names=[f"{name}.{j}" for j in range(len(mine))],
                                                                 op=op, postscale_factor=post)]
        if any(g.shape != w.shape or g.tobytes() != w.tobytes() for g, w in zip(got, want)) or len(got) != len(want):
            bad.append([step, np.dtype(dtype).name, op.name, k])
    return [bad, calls, free, lane.counts]


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


def edges(seed):
    """Special values through synchronous allreduces of the dtypes the compiled step reduces
    (sdp.engine.native): NaNs, infinities, signed zeros and float extremes, integer extremes
    (wrapping as numpy's), every op, a postscale, shapes from one element to 16 KB; the same
    arithmetic as numpy's ufuncs in rank order (:func:`_expected`), every NaN counted as one.
    Each case runs twice: its second call is the compiled entry's (``Runtime.front``, learnt by
    the first).  Then flattened groups of three parts (float32 with a postscale, int64; every
    op), twice each.  Returns (the cases not exact, a digest of every result, how many calls the
    compiled step answered, how many the compiled entry answered, the lane counts)."""
    _never_escalate()  # (as in matrix)
    n, r = sdp.size(), sdp.rank()
    rt = sdp.api.runtime()
    lane = rt.lane
    native_calls = _counting(lane, "_native") if lane._native is not None else [0]  # (it always answers)
    front_calls = _counting(rt, "front") if rt.front is not None else [0]
    specials = {"f": [np.nan, -0.0, 0.0, np.inf, -np.inf, 3.5, -2.25, 1e30, -1e30, 7.0],
                "i": [None, None, -1, 0, 1, 2, -7, 5, 1 << 20, -(1 << 20)]}

    def data(q, dtype, size, s):
        dt = np.dtype(dtype)
        pool = list(specials[dt.kind])
        if dt.kind == "i":
            pool[0], pool[1] = np.iinfo(dt).max, np.iinfo(dt).min
        rng = np.random.default_rng(s * 100 + q)
        return np.array(pool, dt)[rng.integers(0, len(pool), size)]

    bad, digest, cases = [], hashlib.sha256(), 0
    with np.errstate(all="ignore"):
        for dtype in (np.float32, np.float64, np.int32, np.int64):
            for op in OPS:
                for post in (1.0, 0.3):
                    if post != 1.0 and np.dtype(dtype).kind == "i":
                        continue
                    for size in (1, 33, 4096 // np.dtype(dtype).itemsize * 4):
                        s = seed + cases
                        want = _expected(op, [data(q, dtype, size, s) for q in range(n)], post, n)
                        for again in range(2):
                            got = sdp.allreduce(data(r, dtype, size, s), name=f"e{cases}", op=op,
                                                postscale_factor=post)
                            if np.dtype(dtype).kind == "f":  # (a NaN's sign and payload are IEEE 754's to
                                # leave open: numpy's own vector and scalar loops differ there, by alignment)
                                got, want = (np.where(np.isnan(x), np.nan, x).astype(dtype) for x in (got, want))
                            if got.dtype != want.dtype or got.tobytes() != want.tobytes():
                                bad.append([np.dtype(dtype).name, op.name, post, size, again])
                            digest.update(got.tobytes())
                        cases += 1
        for dtype in (np.float32, np.int64):  # (a flattened group: this rank's operand read from its parts,
            for op in OPS:  # the padding between them from its packed copy)
                post = 0.3 if np.dtype(dtype).kind == "f" else 1.0
                s = seed + cases
                parts = [[data(q, dtype, size, s + k).reshape(shape) for k, (size, shape) in
                          enumerate(((1, ()), (33, (33,)), (35, (5, 7))))] for q in range(n)]
                want = [_expected(op, [parts[q][k] for q in range(n)], post, n) for k in range(3)]
                for again in range(2):
                    got = sdp.grouped_allreduce(parts[r], name=f"e{cases}", op=op, postscale_factor=post)
                    for k, (g, w) in enumerate(zip(got, want)):
                        if np.dtype(dtype).kind == "f":
                            g, w = (np.where(np.isnan(x), np.nan, x).astype(dtype) for x in (g, w))
                        if g.dtype != w.dtype or g.shape != w.shape or g.tobytes() != w.tobytes():
                            bad.append(["group", np.dtype(dtype).name, op.name, k, again])
                        digest.update(g.tobytes())
                cases += 1
    return [bad, digest.hexdigest(), native_calls[0], front_calls[0], lane.counts]


def front_paths(rounds):
    """The compiled entry (``Runtime.front``, learnt by a name's first call) on its other roads:
    a peer later than the caller's spin (the request is held, then consumed), a peer later
    than ``ESCALATE_S`` (decided SLOW: the engine runs it), a shape that changes on one rank
    (the engine's ``TensorMismatchError`` on every rank), then its results: new arrays 64-byte
    aligned, apart, of the input's shape (small ones carved out of one chunk, larger ones from
    the engine's allocator), or ``out`` itself.  Returns a dict of what each check saw."""
    import time
    from sdp.common import errors
    n, r = sdp.size(), sdp.rank()
    rt = sdp.api.runtime()
    entered = _counting(rt, "front")
    x = np.arange(256, dtype=np.float32) + r
    want = np.arange(256, dtype=np.float32)
    for q in range(1, n):
        want = want + (np.arange(256, dtype=np.float32) + q)
    seen = {"exact": True}

    def check(got):
        seen["exact"] &= bool(got.shape == want.shape and np.array_equal(got, want))
    for _ in range(3):
        check(sdp.allreduce(x, name="fp", op=sdp.Sum))
    for late_s in (0.002, 0.03):  # (beyond the spin; beyond ESCALATE_S)
        entered[0] = 0
        for _ in range(rounds):
            sdp.barrier()
            if r == n - 1:
                time.sleep(late_s)
            check(sdp.allreduce(x, name="fp", op=sdp.Sum))
        seen[f"entered late {late_s}"] = entered[0]
    seen["slow"] = rt.lane.counts["slow"]
    sdp.barrier()
    try:
        sdp.allreduce(x[:128] if r == n - 1 else x, name="fp", op=sdp.Sum)
        seen["mismatch"] = None
    except errors.TensorMismatchError as e:
        seen["mismatch"] = str(e)
    check(sdp.allreduce(x, name="fp", op=sdp.Sum))
    kept = [sdp.allreduce(x, name="fp", op=sdp.Sum) for _ in range(40)]  # (more than one 64 KB chunk)
    for got in kept:
        check(got)
    seen["apart"] = len({k.ctypes.data for k in kept}) == len(kept)
    seen["aligned"] = all(k.ctypes.data % 64 == 0 for k in kept)
    y = np.full((64, 64), r + 1, np.float64)  # (32 KB: the engine's allocator)
    for _ in range(3):
        got = sdp.allreduce(y, name="fp.big", op=sdp.Max)
    seen["big"] = [list(got.shape), float(got.min()), float(got.max()), got.ctypes.data % 64]
    out = np.empty_like(x)
    seen["out"] = all(sdp.allreduce(x, name="fp", op=sdp.Sum, out=out) is out for _ in range(3))
    check(out)
    inplace, spin = [], rt.lane.spin_s  # (out is the input, on the last rank to post, whose step reduces
    rt.lane.spin_s = 5.0  # at once: the first pass must not overwrite this rank's operand; the others
    for _ in range(3):  # poll until it comes)
        z = np.arange(256, dtype=np.float32) + r
        sdp.barrier()
        if r == n - 1:
            time.sleep(0.001)
        inplace.append(sdp.allreduce(z, name="fp", op=sdp.Sum, out=z) is z and np.array_equal(z, want))
    rt.lane.spin_s = spin
    seen["in place"] = inplace
    seen["entered"] = entered[0]
    return seen


def front_group_paths(rounds):
    """The compiled group entry (``Runtime.front_group``, learnt by a group's first call through
    ``sdp.api._grouped_submit``) and the roads around it: the same group by name (the entry), by
    a new list of equal names each call (the entry), through ``grouped_allreduce_async`` (the
    entry, a late peer's group held and its handle returned), with one name changed, one member not
    C-contiguous or the op changed (``_grouped_submit``, exact), integer AVERAGE (never learnt:
    Python scales), a peer later than the spin (the entry's post held, then consumed), a peer
    later than ``ESCALATE_S`` (the engine), a member's shape changed on one rank
    (``TensorMismatchError`` on every rank).  Returns a dict: per case, whether every result was
    exact and how many calls the entry answered (``entered``) and Python's lane ran
    (``python``)."""
    import time
    from sdp.common import errors
    n, r = sdp.size(), sdp.rank()
    rt = sdp.api.runtime()
    entered = _counting(rt, "front_group")
    python = [0]
    now = rt.lane.allreduce_now

    def counted(*a):
        python[0] += 1
        return now(*a)
    rt.lane.allreduce_now = counted
    shapes = [(), (3,), (2, 5), (100,), (7,)]

    def data(q, dtype, shape, seed):  # (small integers: exact in the engine's order of 3 ranks too)
        return _data(q, np.int32, shape, seed).astype(dtype)

    def arrays(dtype, seed):
        return [data(r, dtype, sh, seed + j) for j, sh in enumerate(shapes)]

    def want(dtype, op, seed):
        return [_expected(op, [data(q, dtype, sh, seed + j) for q in range(n)], 1.0, n)
                for j, sh in enumerate(shapes)]
    seen = {}

    def case(label, calls, dtype=np.float32, op=ReduceOp.SUM, late_s=0.0):
        entered[0], python[0], exact = 0, 0, True
        for k in range(rounds):
            mine, names = arrays(dtype, k), [f"fg.{j}" for j in range(len(shapes))]
            if late_s:
                sdp.barrier()
                if r == n - 1:
                    time.sleep(late_s)
            got = calls(mine, names, op)
            exact &= len(got) == len(shapes) and all(
                g.shape == w.shape and g.dtype == w.dtype and g.tobytes() == w.tobytes()
                for g, w in zip(got, want(dtype, op, k)))
        seen[label] = [exact, entered[0], python[0]]
    member_names = None
    by_name = lambda mine, names, op: sdp.grouped_allreduce(mine, name="fg", op=op)  # noqa: E731

    def same_list(mine, names, op):
        nonlocal member_names
        member_names = member_names or names
        return sdp.api.grouped_allreduce_named(mine, member_names, op)

    def one_renamed(mine, names, op):
        return sdp.api.grouped_allreduce_named(mine, names[:-1] + ["fg.other"], op)

    def strided(mine, names, op):
        mine[3] = np.repeat(mine[3], 2)[::2]
        return sdp.api.grouped_allreduce_named(mine, names, op)
    case("by name", by_name)
    case("new equal lists", lambda mine, names, op: sdp.api.grouped_allreduce_named(mine, names, op))
    case("one renamed", one_renamed)
    case("strided member", strided)
    case("op changed", same_list, op=ReduceOp.MAX)
    case("int average", same_list, dtype=np.int32, op=ReduceOp.AVERAGE)
    case("late 2 ms", same_list, late_s=0.002)
    case("late 30 ms", same_list, late_s=0.03)
    case("again", same_list)

    def waited_async(mine, names, op):  # (grouped_allreduce_async runs the learnt group whole too)
        return [h.wait() for h in sdp.api.grouped_allreduce_async(mine, names, op)]
    case("async", waited_async)
    case("async late 2 ms", waited_async, late_s=0.002)
    case("async late 30 ms", waited_async, late_s=0.03)
    sdp.barrier()
    try:
        mine = arrays(np.float32, 0)
        if r == n - 1:
            mine[2] = mine[2].reshape(10)
        sdp.api.grouped_allreduce_named(mine, [f"fg.{j}" for j in range(len(shapes))], ReduceOp.SUM)
        seen["mismatch"] = None
    except errors.TensorMismatchError as e:
        seen["mismatch"] = str(e)
    case("after the mismatch", same_list)
    return seen


def flush_paths(rounds):
    """The compiled flush (``Context.flush``, from a caller waiting on a burst's batch learnt by
    its first flush) and the roads around it, ``rounds`` steps each: bursts of ``allreduce_async``
    one by one over dtypes, ops, postscales and shapes (a float scale reduced in C, an ``out=``
    part), a peer later than the spin (posted, then held: ``Lane._finish_batch``), a peer later
    than ``ESCALATE_S`` (the engine), integer AVERAGE (never learnt: Python scales), one part's
    shape changed on the last rank (``TensorMismatchError`` on every rank).  Returns a dict: per
    case, [every result exact, flushes the compiled call ran whole, held after it, declined]."""
    import time
    from sdp.common import errors
    n, r = sdp.size(), sdp.rank()
    lane = sdp.api.runtime().lane
    answers = {"whole": 0, "held": 0, "declined": 0}
    ctx = lane._ctx

    class Counted:  # (the lane's Context, its flush's answers counted)
        def __getattr__(self, attr):
            return getattr(ctx, attr)

        def flush(self, b, spin):
            got = ctx.flush(b, spin)
            answers["declined" if got is None else "held" if got is True else "whole"] += 1
            return got
    if ctx is not None:
        lane._ctx = Counted()
    shapes = [(), (3,), (2, 5), (100,), (7,), (64,)]
    seen = {}

    def case(label, dtype=np.float32, op=ReduceOp.SUM, post=1.0, late_s=0.0, bad=None):
        answers.update(whole=0, held=0, declined=0)
        exact = True
        for k in range(rounds):
            data = [[_data(q, np.int32, sh, k + j).astype(dtype) for q in range(n)] for j, sh in enumerate(shapes)]
            wants = [_expected(op, per_rank, post, n) for per_rank in data]
            xs = [per_rank[r] for per_rank in data]
            if bad is not None and r == n - 1:
                xs[bad] = np.zeros(5, dtype)
            out = np.empty_like(xs[2])
            sdp.barrier()
            if late_s and r == n - 1:
                time.sleep(late_s)
            hs = [sdp.allreduce_async(x, name=f"fl.{j}", op=op, postscale_factor=post, out=out if j == 2 else None)
                  for j, x in enumerate(xs)]
            for j, (h, want) in enumerate(zip(hs, wants)):
                try:
                    got = h.wait()
                except errors.TensorMismatchError as e:
                    seen["mismatch"] = str(e) if j == bad else f"fl.{j}: {e}"
                    continue
                exact &= (got.shape == want.shape and got.dtype == want.dtype and got.tobytes() == want.tobytes()
                          and (j != 2 or got is out))
        seen[label] = [bool(exact), answers["whole"], answers["held"], answers["declined"]]
    for dtype, op, post in ((np.float32, ReduceOp.SUM, 1.0), (np.float64, ReduceOp.AVERAGE, 0.5),
                            (np.int32, ReduceOp.MAX, 1.0), (np.int64, ReduceOp.PRODUCT, 1.0),
                            (np.float32, ReduceOp.MIN, 2.0)):
        case(f"{np.dtype(dtype).name} {op.name} {post:g}", dtype, op, post)
    case("int average", np.int32, ReduceOp.AVERAGE)
    case("late 2 ms", late_s=0.002)
    case("late 30 ms", late_s=0.03)
    sdp.barrier()
    case("bad shape", bad=4)
    case("after the mismatch")
    return seen


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
