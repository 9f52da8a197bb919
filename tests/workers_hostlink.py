"""Worker functions for tests/test_hostlink.py (ranks on fake hosts, see SDP_HOSTNAME)."""
import hashlib
import os
import signal
import time

import numpy as np

import sdp


def _link():
    return sdp.api.runtime().link


def cases():
    """Synchronous allreduces of every op, eligible dtype and scale (``out=``, in place, shapes,
    the largest eligible size, inputs and outputs not aligned) against numpy, twice (a name's
    second call enters the compiled entry), then ineligible ones (float16, a strided view, a
    prescale, 128 KB, a name only some hosts use this position for) and asynchronous ones
    between them: [what differed, SHA-1 of the results, link FASTs, positions posted, FASTs the
    compiled step or entry ran whole]."""
    r, n = sdp.rank(), sdp.size()
    rng = [np.random.default_rng(q) for q in range(n)]
    base = [g.standard_normal(300) for g in rng]
    bad, out = [], []

    def check(got, want, dtype, exact):
        good = got.dtype == dtype and got.shape == want.shape and (
            np.array_equal(got, want) if exact else np.allclose(got, want, rtol=1e-5, atol=1e-4))
        if not good:
            bad.append(f"#{len(out)}: {got.dtype} {got.shape} {got.reshape(-1)[:3]} vs {want.reshape(-1)[:3]}")
        out.append(np.asarray(got))

    for _ in range(2):  # (a name's first call: Python and the compiled step; its second: the compiled entry)
        for dtype in (np.float32, np.float64, np.int32, np.int64):
            xs = [(b * 100).astype(dtype) for b in base]
            exact = np.dtype(dtype).kind == "i"
            wide = [x.astype(np.float64) for x in xs]
            for op, ref in ((sdp.Sum, sum(wide)), (sdp.Min, np.minimum.reduce(wide)),
                            (sdp.Max, np.maximum.reduce(wide)),
                            (sdp.Product, np.prod(np.stack([np.sign(w) for w in wide]), axis=0))):
                x = np.sign(xs[r]).astype(dtype) if op == sdp.Product else xs[r]
                check(sdp.allreduce(x, name=f"hl.{np.dtype(dtype).name}.{op}", op=op), ref.astype(dtype), dtype, exact)
            avg = sdp.allreduce(xs[r], name=f"hl.{np.dtype(dtype).name}.avg", op=sdp.Average)
            want = (sum(x.astype(np.int64) for x in xs) // n).astype(dtype) if exact else (sum(wide) / n).astype(dtype)
            check(avg, want, dtype, exact)
        check(sdp.allreduce(base[r].astype(np.float32), name="hl.post", op=sdp.Sum, postscale_factor=0.5),
              (sum(base) * 0.5).astype(np.float32), np.float32, False)
        buf = np.empty((3, 100), np.float32)
        got = sdp.allreduce(base[r].astype(np.float32).reshape(3, 100), name="hl.out", op=sdp.Sum, out=buf)
        if got is not buf:
            bad.append("out= not returned")
        check(buf, sum(base).astype(np.float32).reshape(3, 100), np.float32, False)
        mine = np.full(7, r + 1, np.int64)
        sdp.allreduce(mine, name="hl.inplace", op=sdp.Sum, out=mine)
        check(mine, np.full(7, n * (n + 1) // 2, np.int64), np.int64, True)
        check(sdp.allreduce(np.array(r + 0.5), name="hl.0d", op=sdp.Sum), np.array(n * n / 2), np.float64, True)
        big = np.full(16384, r, np.float32)  # 64 KB: the largest eligible
        check(sdp.allreduce(big, name="hl.64k", op=sdp.Sum), np.full(16384, n * (n - 1) / 2, np.float32),
              np.float32, True)
        # an input and an output not aligned to their items (the compiled step hands them to Python)
        odd_in = np.frombuffer(bytearray(4 * 9 + 1), np.uint8)[1:].view(np.float32)
        odd_in[:] = r + 1
        odd_out = np.frombuffer(bytearray(4 * 9 + 1), np.uint8)[1:].view(np.float32)
        check(sdp.allreduce(odd_in, name="hl.odd", op=sdp.Sum, out=odd_out), np.full(9, n * (n + 1) / 2, np.float32),
              np.float32, True)
        if odd_out.flags.aligned or odd_in.flags.aligned:
            bad.append("the unaligned arrays are aligned")
    fast = _link().fast
    # not eligible here (the engine on every rank), each still one position
    check(sdp.allreduce(np.full(5, r, np.float16), name="hl.f16", op=sdp.Sum),
          np.full(5, n * (n - 1) / 2, np.float16), np.float16, True)
    strided = (np.arange(20, dtype=np.float32) * (r + 1))[::2]
    check(sdp.allreduce(strided, name="hl.strided", op=sdp.Sum),
          np.arange(20, dtype=np.float32)[::2] * (n * (n + 1) / 2), np.float32, True)
    check(sdp.allreduce(np.ones(4, np.float32), name="hl.pre", op=sdp.Sum, prescale_factor=2.0),
          np.full(4, 2.0 * n, np.float32), np.float32, True)
    check(sdp.allreduce(np.ones(32768, np.float32), name="hl.128k", op=sdp.Sum),
          np.full(32768, n, np.float32), np.float32, True)
    # the first host calls this position "hl.a", the others "hl.b" first: SLOW, then the engine
    # matches the names (both are submitted by then: one each way per rank, asynchronously)
    first = r in sdp.api.runtime().link.local and sdp.api.runtime().link.leader == 0
    h = sdp.allreduce_async(np.full(3, r, np.float32), name="hl.b" if first else "hl.a", op=sdp.Sum)
    got = sdp.allreduce(np.full(3, r, np.float32), name="hl.a" if first else "hl.b", op=sdp.Sum)
    check(got, np.full(3, n * (n - 1) / 2, np.float32), np.float32, True)
    check(h.wait(), np.full(3, n * (n - 1) / 2, np.float32), np.float32, True)
    if _link().fast != fast:
        bad.append(f"{_link().fast - fast} ineligible calls took the link")
    # and the path still runs afterwards, around asynchronous submissions
    hs = [sdp.allreduce_async(np.full(10, r, np.float32), name=f"hl.async.{i}", op=sdp.Sum) for i in range(3)]
    check(sdp.allreduce(np.full(2, r, np.float64), name="hl.after", op=sdp.Sum), np.full(2, n * (n - 1) / 2),
          np.float64, True)
    for hd in hs:
        check(hd.wait(), np.full(10, n * (n - 1) / 2, np.float32), np.float32, True)
    sdp.barrier()
    return [bad, hashlib.sha1(b"".join(o.tobytes() for o in out)).hexdigest(), _link().fast, _link().k,
            _link().compiled]


def mismatch(kind, learnt=False):
    """A synchronous allreduce that differs on the last rank (``kind``: shape, dtype or op;
    ``learnt``: after two that agree, so the others enter it through the compiled entry):
    [error type, message, seconds, whether a later allreduce is exact and took the link]."""
    r, n = sdp.rank(), sdp.size()
    sdp.allreduce(np.ones(4, np.float32), name="mm.warm", op=sdp.Sum)
    x, op = np.ones(4, np.float32), sdp.Sum
    for _ in range(2 if learnt else 0):
        sdp.allreduce(x, name="mm.x", op=op)
    if r == n - 1:
        x, op = {"shape": (np.ones(5, np.float32), op), "dtype": (np.ones(4, np.float64), op),
                 "op": (x, sdp.Max)}[kind]
    t0 = time.monotonic()
    try:
        sdp.allreduce(x, name="mm.x", op=op)
        etype, msg = None, None
    except sdp.TensorMismatchError as e:
        etype, msg = type(e).__name__, str(e)
    seconds = time.monotonic() - t0
    fast = _link().fast
    after = sdp.allreduce(np.ones(4, np.float32), name="mm.after", op=sdp.Sum)
    return [etype, msg, seconds, bool(np.array_equal(after, np.full(4, float(n)))) and _link().fast == fast + 1]


def join_midway():
    """The last rank joins after two allreduces, the others make three more: their results
    count the joined rank as zeros (the engine's join), and the path is off on every rank."""
    r, n = sdp.rank(), sdp.size()
    got = [float(sdp.allreduce(np.full(2, r + 1.0), name=f"jm.{i}", op=sdp.Sum)[0]) for i in range(2)]
    if r == n - 1:
        last = sdp.join()
    else:
        got += [float(sdp.allreduce(np.full(2, r + 1.0), name=f"jm.{i}", op=sdp.Sum)[0]) for i in range(2, 5)]
        last = sdp.join()
    return [got, last, _link().off, _link().fast]


def killed_while_waiting(victim):
    """Rank ``victim`` dies (SIGKILL) while the others wait in the link for it: [error type,
    seconds from the kill (as the others see it) to the error]."""
    r = sdp.rank()
    sdp.allreduce(np.ones(4, np.float32), name="kw.warm", op=sdp.Sum)
    sdp.barrier()
    if r == victim:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        sdp.allreduce(np.ones(4, np.float32), name="kw.x", op=sdp.Sum)
        return [None, time.monotonic() - t0]
    except sdp.errors.SdpError as e:
        return [type(e).__name__, time.monotonic() - t0 - 0.3]


def stall(mode):
    """The last rank makes a broadcast (``mode`` "broadcast") where the others make a synchronous
    allreduce (a program Horovod would stall on), or nothing for 8 s ("silent"): [error type,
    message, seconds]."""
    r, n = sdp.rank(), sdp.size()
    t0 = time.monotonic()
    try:
        if r == n - 1 and mode == "silent":
            time.sleep(8)
            return [None, None, time.monotonic() - t0]
        if r == n - 1:
            sdp.broadcast(np.ones(3, np.float32), 0, name="st.b")
        else:
            sdp.allreduce(np.ones(3, np.float32), name="st.a", op=sdp.Sum)
        return [None, None, time.monotonic() - t0]
    except sdp.errors.SdpError as e:
        return [type(e).__name__, str(e), time.monotonic() - t0]


def malformed_link():
    """Host 1's leader (rank 2) sends rank 0 malformed link messages before its real ones: rank 0
    logs and drops them, and the allreduces are exact and take the link: [results, link FASTs]."""
    import struct
    from sdp.engine import hostlink
    r, link = sdp.rank(), _link()
    if r == 2:
        k = link.k + 1
        head = hostlink._MSG.pack(hostlink.MAGIC, k, 5, 8)
        for bad in (b"", b"\x00" * 7, b"XXXX" + head[4:] + bytes(8),  # short, shorter, another magic
                    head + bytes(4),  # a length that does not match
                    hostlink._MSG.pack(hostlink.MAGIC, k + 7, 5, 8) + bytes(8),  # a position far ahead
                    hostlink._MSG.pack(hostlink.MAGIC, k, 5, 0),  # a signature without bytes
                    hostlink._MSG.pack(hostlink.MAGIC, k, 5, 1 << 40) + bytes(8),  # a huge length
                    struct.pack("<Q", 1)):
            link.mesh.link_send(0, bad)
    got = [float(sdp.allreduce(np.full(3, 1.0 + i), name=f"ml.{i}", op=sdp.Sum)[0]) for i in range(3)]
    return [got, link.fast]


def link_state():
    """One synchronous allreduce: [its result, the link on here, link FASTs, leaders still listening]."""
    link = _link()
    got = float(sdp.allreduce(np.full(3, 1.0 + sdp.rank()), name="ls.x", op=sdp.Sum)[0])
    leader = sdp.api.runtime().mesh.link
    return [got, link is not None, link.fast if link else 0, leader is not None and leader._listener is not None]


def late_ranks():
    """Calls of a name the link has learnt where one rank comes 30 ms late (host 0's follower,
    host 1's leader, host 0's leader, host 1's follower in turn): the others' compiled spins run
    out and Python goes on with the position.  [results, link FASTs, of which compiled]."""
    r = sdp.rank()
    x = np.full(3, r + 1.0, np.float32)
    for _ in range(3):
        sdp.allreduce(x, name="late.x", op=sdp.Sum)
    link = _link()
    fast, compiled, got = link.fast, link.compiled, []
    for late in (1, 2, 0, 3):
        if r == late:
            time.sleep(0.03)
        got.append(float(sdp.allreduce(x, name="late.x", op=sdp.Sum)[0]))
    return [got, link.fast - fast, link.compiled - compiled]
