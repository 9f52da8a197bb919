"""Adasum: adaptive summation of gradients (Maleki et al., "Scaling Distributed Training with
Adaptive Summation", MLSys 2021), as Horovod's ``AdasumMPIAllreduceOp`` computes it.

Two vectors combine as ``adasum(a, b) = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b``: their sum
when they are orthogonal, their average when they are parallel.  A coefficient is 1 where that
vector's squared norm is below ``sqrt(DBL_MIN)`` (:data:`ZERO_NORM_SQ`), so a zero vector lets
the other through unchanged, and two zero vectors give zeros.  Dot products and norms are per
tensor (per layer), also inside a fused buffer: ``starts`` gives each tensor's first element.

:func:`allreduce` runs Horovod's vector-halving, distance-doubling tree over ``2**k`` ranks: at
level ``d`` (1, 2, 4, ...) rank ``r`` and ``r ^ d`` split their common range in halves, each
keeps one (the lower rank the first), sends the other and combines what it receives with what it
kept; the left operand of a level is always the half-tree of the lower ranks.  The partial dot
products and squared norms of every tensor are summed over the ``2d`` ranks that hold its
pieces (recursive doubling on float64, identical bits on each), so every piece of a tensor gets
the same coefficients.  Then the halves travel back, distance-halving, until every rank holds
the whole result (bit-identical on every rank: each element is computed by one rank).  The
result equals the tree reduction ``adasum(adasum(x0, x1), adasum(x2, x3))`` of the ranks' inputs.

Arithmetic as Horovod's: dot products and norms in float64; the combination in float64 for
float32/float64 and in float32 for float16 (Horovod's F16C path), rounded to the dtype once per
level; messages carry the dtype itself.  Other dtypes and a number of ranks that is not a power
of two are refused before anything is sent (:func:`check`, with Horovod's ``NotImplementedError``).

:func:`hierarchical`: Horovod's Adasum when built with NCCL: the ranks of each host average
their inputs (the engine's same-host allreduce, float16 in float32), the host leaders combine the
host averages with :func:`allreduce`, and each leader broadcasts the result to its host.
"""
import bisect
import math
import sys
from typing import List, Optional, Sequence

import numpy as np

from sdp.common.errors import ProtocolError
from sdp.engine import collectives
from sdp.transport.zmq_mesh import DATA

#: Horovod's threshold (``sqrt(DBL_MIN)``): a tensor whose squared norm is below it counts as zero
ZERO_NORM_SQ = math.sqrt(sys.float_info.min)
_AUX_DOTS = 1  # the aux field of the dot-product messages (data segments travel with aux 0)
_BLOCK = 64 << 10  # elements combined at a time in the wider dtype (stays in L2)


def check(size: int, ps: int, hosts: Optional[List[List[int]]] = None) -> None:
    """Raise Horovod's ``NotImplementedError`` where Adasum cannot run: a process set other than the
    global one (``ps`` != 0), a number of ranks (``size``) that is not a power of two, or, for
    :func:`hierarchical` (``hosts``: the ranks of every host), a number of hosts that is not.
    Every rank raises alike: it depends only on what every rank knows."""
    if ps:
        raise NotImplementedError(f"Adasum does not support non-global process sets yet. (process set {ps})")
    if hosts is not None:
        if len(hosts) & (len(hosts) - 1):
            raise NotImplementedError(f"Running Adasum with non-power of 2 nodes is not supported yet. (hierarchical "
                                      f"Adasum, SDP_HIERARCHICAL=1, across {len(hosts)} hosts; ranks per host "
                                      f"{[len(h) for h in hosts]})")
    elif size & (size - 1):
        raise NotImplementedError(f"Running Adasum with non-power of 2 ranks is not supported yet. (size() is {size}; "
                                  "Adasum combines ranks in pairs: 1, 2, 4, 8, ... ranks)")


def tensor_starts(layouts: Sequence, offs: Sequence[int]) -> List[int]:
    """Every tensor's first element in a fused buffer whose requests lie at ``offs``
    (:func:`sdp.engine.fusion.offsets`), given each request's ``layout`` (a flattened group's
    :class:`~sdp.engine.fusion.Layout`: its parts at its ``starts``; None: one tensor); the
    total last.  Padding belongs to the tensor before it (zeros: adds nothing)."""
    out = []
    for layout, off in zip(layouts, offs):
        out.extend([off] if layout is None else [off + s for s in layout.starts])
    out.append(offs[-1])
    return out


def allreduce(mesh, buf: np.ndarray, starts: Sequence[int], seq: int, segment_bytes: int) -> None:
    """Adasum of every rank's ``buf`` (1-D float16/32/64, the same size on every rank of
    ``mesh``, a power of two of them) into ``buf`` on every rank; ``starts``: the tensors' first
    elements and the total (see :func:`tensor_starts`).  Messages carry ``seq``; data travels in
    frames of ``segment_bytes``."""
    n, r = mesh.size, mesh.rank
    if n == 1 or buf.size == 0:
        return
    wire = collectives._Wire(mesh, seq, segment_bytes, buf.dtype)
    scratch = np.empty(buf.size - buf.size // 2, buf.dtype)  # the partner's copy of the half kept
    lo, hi, level, taken = 0, buf.size, 1, []
    while level < n:  # halving: at each level the range this rank holds halves
        left, mid = not r & level, lo + (hi - lo) // 2
        keep, give = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
        wire.send(r ^ level, buf[give[0]:give[1]])
        theirs = scratch[:keep[1] - keep[0]]
        for s, seg in wire.recv_each(r ^ level, theirs.size):
            theirs[s:s + seg.size] = seg
        taken.append((lo, hi, give))
        lo, hi = keep
        _combine(mesh, buf, theirs, lo, starts, left, level, seq)
        level <<= 1
    wire.finish()  # (what was given away is overwritten below)
    while taken:  # doubling: the partner's half comes back
        level >>= 1
        lo, hi, (a, b) = taken.pop()
        wire.send(r ^ level, buf[b:hi] if a == lo else buf[lo:a])  # (mine: the other side of give)
        for s, seg in wire.recv_each(r ^ level, b - a):
            buf[a + s:a + s + seg.size] = seg
    wire.finish()  # (the result is the caller's once this returns)


def _combine(mesh, buf, theirs, lo, starts, left: bool, level: int, seq: int) -> None:
    """``buf[lo:lo + theirs.size]`` (this rank's piece of one operand) and ``theirs`` (the same
    piece of the other) become their Adasum, tensor by tensor, with coefficients from the dot
    products and norms summed over the ``2 * level`` ranks holding the tensors' pieces."""
    hi = lo + theirs.size
    mine = buf[lo:hi]
    ntensors = len(starts) - 1
    pieces = []  # (tensor, start, end) relative to lo
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while i < ntensors and starts[i] < hi:
        a, b = max(starts[i], lo), min(starts[i + 1], hi)
        if a < b:
            pieces.append((i, a - lo, b - lo))
        i += 1
    dots = np.zeros(3 * ntensors)  # per tensor: a.b, |left|^2, |right|^2
    for i, a, b in pieces:
        ab, aa, bb = _dot3(mine[a:b], theirs[a:b])
        dots[3 * i:3 * i + 3] = (ab, aa, bb) if left else (ab, bb, aa)
    bit, r = 1, mesh.rank
    while bit <= level:  # summed over the ranks r ^ (any bits up to level)
        mesh.send(r ^ bit, DATA, seq, _AUX_DOTS, dots.tobytes())
        frames = mesh.recv(r ^ bit, DATA, seq=seq, aux=_AUX_DOTS)
        got = np.frombuffer(frames[0].buffer, np.uint8) if len(frames) == 1 else None
        if got is None or got.size != dots.nbytes:
            raise ProtocolError(f"rank {r}: Adasum dot products from rank {r ^ bit}: expected one frame of "
                                f"{dots.nbytes} bytes")
        dots += got.view(np.float64)  # (a + b == b + a: the same bits on both ranks)
        bit <<= 1
    dot, lsq, rsq = dots[0::3], dots[1::3], dots[2::3]
    one = np.ones(ntensors)
    lcoef = 1.0 - np.divide(dot, lsq, out=np.zeros(ntensors), where=lsq >= ZERO_NORM_SQ) * 0.5
    rcoef = 1.0 - np.divide(dot, rsq, out=np.zeros(ntensors), where=rsq >= ZERO_NORM_SQ) * 0.5
    lcoef, rcoef = np.where(lsq >= ZERO_NORM_SQ, lcoef, one), np.where(rsq >= ZERO_NORM_SQ, rcoef, one)
    mcoef, tcoef = (lcoef, rcoef) if left else (rcoef, lcoef)
    for i, a, b in pieces:
        _scaled_add(mine[a:b], float(mcoef[i]), theirs[a:b], float(tcoef[i]))


def _dot3(a: np.ndarray, b: np.ndarray) -> tuple:
    """``(a.b, a.a, b.b)`` in float64 (``np.einsum``'s own loop, casting as it goes: ``np.dot``
    and ``np.vdot`` of 1-D arrays may wake OpenBLAS's threads, 7 us or 1-16 ms for 64 K doubles
    on this loaded 2-core machine; a float64 copy first took ~1.4x as long)."""
    f = np.float64
    return (float(np.einsum("i,i->", a, b, dtype=f)), float(np.einsum("i,i->", a, a, dtype=f)),
            float(np.einsum("i,i->", b, b, dtype=f)))


def _scaled_add(a: np.ndarray, ca: float, b: np.ndarray, cb: float) -> None:
    """``a = ca * a + cb * b`` (``b`` is scratch): in float64 for float32/float64, in float32 for
    float16 (the coefficients rounded to float32 too), rounded to ``a``'s dtype once."""
    if a.dtype == np.float64:
        np.multiply(a, ca, out=a)
        np.multiply(b, cb, out=b)
        np.add(a, b, out=a)
        return
    acc = np.float32 if a.dtype == np.float16 else np.float64
    t, u = np.empty(min(a.size, _BLOCK), acc), np.empty(min(a.size, _BLOCK), acc)
    ca, cb = acc(ca), acc(cb)
    for s in range(0, a.size, _BLOCK):  # (one conversion each way: a ufunc casting as it goes is ~5x slower)
        m = min(_BLOCK, a.size - s)
        np.copyto(t[:m], a[s:s + m])
        np.copyto(u[:m], b[s:s + m])
        np.multiply(t[:m], ca, out=t[:m])
        np.multiply(u[:m], cb, out=u[:m])
        np.add(t[:m], u[:m], out=t[:m])
        np.copyto(a[s:s + m], t[:m], casting="same_kind")


def hierarchical(hier, leaders, buf: np.ndarray, starts: Sequence[int], seqs: Sequence[int],
                 segment_bytes: int) -> None:
    """Adasum across hosts (:class:`sdp.engine.groups.Hierarchy` ``hier``): the average of each
    host's ranks, combined by :func:`allreduce` among ``leaders`` (the group of every host's
    lowest rank; None on the other ranks), broadcast to every rank of the host.  ``seqs``: three
    collective numbers, the same on every rank."""
    host = hier.host
    if host.size > 1:
        acc = np.dtype(np.float32) if buf.dtype == np.float16 else None
        collectives.allreduce(host, buf, buf, np.add, seqs[0], segment_bytes, acc, 1.0 / host.size)
    if leaders is not None:
        allreduce(leaders, buf, starts, seqs[1], segment_bytes)
    if host.size > 1:
        collectives.broadcast(host, buf, 0, seqs[2], segment_bytes)
