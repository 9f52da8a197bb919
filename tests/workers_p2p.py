"""Worker functions of tests/test_p2p_mp.py: ``sdp.send``/``sdp.recv`` between real rank processes
(tests/harness.py).  Each returns the list of what went wrong (empty: all good) or what it saw."""
import os
import time

import numpy as np

import sdp
from sdp.engine.p2p import PIECE

# (dtype, element count): empty, 1 KB, two pieces (the second short), three whole pieces
SIZES = [("int32", 0), ("float32", 256), ("float64", (PIECE + 1000) // 8), ("uint8", 3 * PIECE)]


def _value(src: int, tag: int, i: int, dtype: str, count: int) -> np.ndarray:
    return ((np.arange(count) * 7 + src * 1000 + tag * 10 + i) % 251).astype(dtype)


def ring():
    """Every rank sends each size to the next rank under two tags, twice per tag, and receives
    from the previous: the receives of tag 4 posted before the sends, those of tag 3 after them
    (tags interleave; the two messages of a tag arrive in order); a sent buffer overwritten as
    soon as its send's ``wait()`` returns must not change what arrives."""
    r, n = sdp.rank(), sdp.size()
    nxt, prv = (r + 1) % n, (r - 1) % n
    problems = []
    plan = [(tag, i, dtype, count) for dtype, count in SIZES for tag in (3, 4) for i in range(2)]
    outs = [np.full(count, 255, dtype) for _, _, dtype, count in plan]
    early = [sdp.recv(o, prv, tag) for o, (tag, _, _, _) in zip(outs, plan) if tag == 4]
    sends = []
    for tag, i, dtype, count in plan:
        buf = _value(r, tag, i, dtype, count)
        sends.append((sdp.send(buf, nxt, tag), buf))
    late = [sdp.recv(o, prv, tag) for o, (tag, _, _, _) in zip(outs, plan) if tag == 3]
    for h, buf in sends:
        if h.wait(timeout=60) is not None:
            problems.append("send's wait() returned something")
        buf[...] = 0  # (the caller's again: nothing of this may reach the peer)
    for h in early + late:
        h.wait(timeout=60)
    for out, (tag, i, dtype, count) in zip(outs, plan):
        if not np.array_equal(out, _value(prv, tag, i, dtype, count)):
            problems.append(f"tag {tag} #{i} {dtype}[{count}]: wrong values")
    return problems


def in_order_per_tag():
    """Rank 0 sends 4 messages under one tag and 1 under another first; rank 1 receives the other
    tag's first, then the 4 in order."""
    r = sdp.rank()
    if r == 0:
        hs = [sdp.send(np.array([9.0]), 1, tag=8)] + [sdp.send(np.array([float(k)]), 1, tag=7) for k in range(4)]
        for h in hs:
            h.wait(timeout=60)
        return []
    if r == 1:
        got8 = sdp.recv(np.empty(1), 0, tag=8).wait(timeout=60)
        got7 = [float(sdp.recv(np.empty(1), 0, tag=7).wait(timeout=60)[0]) for _ in range(4)]
        return [] if (float(got8[0]), got7) == (9.0, [0.0, 1.0, 2.0, 3.0]) else [f"got {got8} {got7}"]
    return []


def mismatch():
    """Rank 0 sends 3 floats, then two pieces' worth under the same tag; rank 1 receives the first
    into 4 floats (TensorMismatchError), the second as sent.  Returns [error type, message,
    second message right]."""
    r = sdp.rank()
    big = _value(0, 9, 0, "float32", PIECE // 4 + 5)
    if r == 0:
        sdp.send(np.ones(3, np.float32), 1, tag=9).wait(timeout=60)
        sdp.send(big, 1, tag=9).wait(timeout=60)
        return None
    if r == 1:
        try:
            sdp.recv(np.empty(4, np.float32), 0, tag=9).wait(timeout=60)
            seen = ["none", ""]
        except sdp.errors.TensorMismatchError as e:
            seen = [type(e).__name__, str(e)]
        second = sdp.recv(np.empty_like(big), 0, tag=9).wait(timeout=60)
        return seen + [bool(np.array_equal(second, big))]
    return None


def bad_arguments():
    """What each wrong call raises on this rank: [[type, message], ...]."""
    r, n = sdp.rank(), sdp.size()
    calls = [lambda: sdp.send(np.ones(2), r), lambda: sdp.send(np.ones(2), n), lambda: sdp.send(np.ones(2), -1),
             lambda: sdp.recv(np.ones(2), (r + 1) % n, tag=-1), lambda: sdp.recv(np.ones(2), (r + 1) % n, tag=2 ** 32),
             lambda: sdp.recv(np.ones(4)[::2], (r + 1) % n), lambda: sdp.recv([0.0, 0.0], (r + 1) % n),
             lambda: sdp.send(np.ones(2), "1")]
    out = []
    for call in calls:
        try:
            call()
            out.append(["none", ""])
        except ValueError as e:
            out.append([type(e).__name__, str(e)])
    return out


def peer_dies():
    """Rank 0 waits for a message that rank 1 never sends: rank 1 exits (os._exit) after a
    barrier.  Returns rank 0's [error type, message, seconds from the barrier]."""
    r = sdp.rank()
    h = sdp.recv(np.empty(4), 1, tag=1) if r == 0 else None
    sdp.barrier()
    if r == 1:
        os._exit(0)
    t0 = time.monotonic()
    try:
        h.wait(timeout=60)
        return ["none", "", time.monotonic() - t0]
    except sdp.errors.SdpError as e:
        return [type(e).__name__, str(e), time.monotonic() - t0]
