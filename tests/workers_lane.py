"""Worker functions for the fast lane (sdp.engine.lane), run inside real rank processes: the
lane's arithmetic (every op x dtype x postscale, special values, synchronous and asynchronous
calls mixed, against Horovod's arithmetic in rank order) and the helpers the other lane
workers share (``workers_lane_flow``: order, bursts, batches, groups, joins and faults;
``workers_lane_front``: the compiled entries).  Split by topic so that each file stays short."""
import hashlib
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
