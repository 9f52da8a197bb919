"""Worker functions for the fast lane's compiled entries, run inside real rank processes: the
compiled allreduce entry (``Runtime.front``), the compiled group entry (``Runtime.front_group``)
and the compiled flush of a burst's batch, each on the roads around it (late peers, escalation
to the engine, mismatches, what is never learnt).  The arithmetic and helpers are
``workers_lane``'s."""
import numpy as np

import sdp
from sdp.common.reduce_ops import ReduceOp
from workers_lane import _counting, _data, _expected


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
