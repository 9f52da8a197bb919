"""Collective algorithms on a :class:`~sdp.transport.zmq_mesh.Mesh`, on 1-D numpy buffers.

All functions are called by every rank in the same order with the same ``seq`` (the engine's
agreed collective number), so that messages can be checked against what is expected.

* ``allreduce``: recursive doubling for small buffers (latency: log2(n) hops), pipelined ring
  (reduce-scatter + allgather, ``segment_bytes`` frames) for large ones (bandwidth: each rank
  sends 2(n-1)/n of the buffer).  Every rank ends with bit-identical results.
* ``allreduce`` when every rank is on one host: through shared memory (:func:`_shm_allreduce`),
  with :mod:`sdp.engine.barrier` between phases (shared-memory flags, or ZeroMQ messages); each
  rank reduces its 1/n of every slab straight out of the peers' segments and, when every rank's
  output lives in its result pool, writes it straight into every rank's output (no copy-out).
* ``allreduce_hierarchical`` when the ranks span several hosts: shared memory within each host,
  ZeroMQ between hosts (one cross group per part of the buffer, see :mod:`sdp.engine.groups`).
* ``broadcast``: binomial tree from ``root``.
* ``allgatherv``: ring over variable-size blocks (``allgatherv_hierarchical`` across hosts: cross
  groups, then each host's ranks).
* ``alltoallv``: pairwise exchange.
* ``reducescatter``: the reduce-scatter half of the ring.
"""
import numpy as np

from sdp.common.errors import ProtocolError
from sdp.common.reduce_ops import scale_in_place
from sdp.engine import barrier
from sdp.transport.zmq_mesh import DATA

SMALL_BYTES = 64 * 1024  # at or below this, allreduce uses recursive doubling


def _frombuf(frame, dtype):
    return np.frombuffer(frame.buffer, dtype=dtype)


class _Wire:
    """Segmented send/recv of a buffer's slices between two peers for one collective."""

    def __init__(self, mesh, seq, segment_bytes, dtype):
        self.mesh, self.seq, self.dtype = mesh, seq, dtype
        self.seg = max(1, segment_bytes // max(1, dtype.itemsize))
        self.trackers = []
        self.aux = 0

    def send(self, dst, arr):
        """Send ``arr`` (1-D view) to ``dst`` as consecutive segments (at least one)."""
        n = arr.size
        starts = range(0, n, self.seg) if n else [0]
        raw = arr.view(np.uint8)  # byte view: also exports dtypes without a buffer format (bfloat16)
        step = self.seg * arr.dtype.itemsize
        for s in starts:
            b = s * arr.dtype.itemsize
            self.trackers.append(self.mesh.send(dst, DATA, self.seq, 0, raw[b:b + step]))

    def recv_each(self, src, n):
        """Yield ``(start, segment_array)`` for the ``n`` elements expected from ``src``."""
        starts = range(0, n, self.seg) if n else [0]
        for s in starts:
            frames = self.mesh.recv(src, DATA, seq=self.seq)
            if len(frames) != 1:
                raise ProtocolError(f"expected one data frame from rank {src}, got {len(frames)}")
            seg = _frombuf(frames[0], self.dtype)
            want = min(self.seg, n - s)
            if seg.size != want:
                raise ProtocolError(f"rank {self.mesh.rank}: segment from rank {src} has {seg.size} "
                                    f"elements, expected {want}")
            yield s, seg

    def finish(self):
        self.mesh.sendrecv_done(self.trackers)


def _bounds(n_elems, parts, unit=1):
    """Split ``n_elems`` into ``parts`` contiguous ranges, first ones larger, every inner edge a
    multiple of ``unit`` (the last range takes the remainder)."""
    rows = n_elems // unit
    base, extra = divmod(rows, parts)
    edges = [0]
    for i in range(parts):
        edges.append(edges[-1] + (base + (i < extra)) * unit)
    edges[-1] = n_elems
    return edges


def allreduce(mesh, inp, out, ufunc, seq, segment_bytes, acc=None, scale=None, fill=None, done=None):
    """Reduce ``inp`` across all ranks with ``ufunc`` into ``out`` (both 1-D, contiguous, same
    size/dtype; ``out`` may be ``inp``).  ``inp`` is not modified unless it is ``out``.

    ``acc`` is an optional accumulation dtype (float32 for float16/bfloat16 payloads); ``scale``
    an optional factor for the result (AVERAGE's 1/n), applied in float32 before 16-bit rounding
    (in the last reduction step; off shared memory with more than 2 ranks, to the contributions
    before a SUM), so an average of large float16 values does not overflow.
    An ``out`` from this rank's shared-memory result pool is written by the peers directly.

    ``fill(lo, hi)``, when given, writes elements ``[lo, hi)`` of ``inp`` (which must then be
    ``out``): a fusion bucket packed on demand.  Every element is filled before it is read; the
    ring fills the chunk it sends first segment by segment, each sent as soon as it is filled, so
    packing overlaps the first sends.  ``done(lo, hi)``, when given, is called as elements
    ``[lo, hi)`` of ``out`` are final: by the ring as its allgather receives them (so the caller
    can pass them on while the rest is in flight), by the shared-memory path slab by slab, else
    once for all of ``out``."""
    n = mesh.size
    shm = uses_shm(mesh, inp.nbytes, inp.size)
    ring = not shm and n > 1 and inp.nbytes > SMALL_BYTES and inp.size >= n
    if fill is not None and not ring:
        fill(0, inp.size)
    if not shm and out is not inp:
        np.copyto(out, inp)
    if n == 1 or inp.size == 0:
        if scale is not None:
            scale_in_place(out, scale)
    elif shm:
        _shm_allreduce(mesh, inp, out, ufunc, seq, acc, scale, done=done)
        return
    else:
        _wire_allreduce(mesh, out, ufunc, seq, segment_bytes, acc, scale, fill, done)
        return
    if done is not None:
        done(0, out.size)


def _wire_allreduce(mesh, out, ufunc, seq, segment_bytes, acc, scale, fill, done):
    """:func:`allreduce` over ZeroMQ, in place in ``out``."""
    n = mesh.size
    if acc is not None and scale is not None and n > 2 and ufunc is np.add:
        # 16-bit partial sums of 2..n-1 ranks travel rounded: scale the contributions first, so
        # that no partial sum of an average can overflow (the last step adds in float32 anyway)
        if fill is not None:
            fill(0, out.size)
            fill = None
        wide = out.astype(acc)
        np.multiply(wide, scale, out=wide)
        out[...] = wide
        scale = None
    if out.nbytes <= SMALL_BYTES or out.size < n:
        _recursive_doubling(mesh, out, ufunc, seq, acc, scale)
        if done is not None:
            done(0, out.size)
    else:
        edges = _bounds(out.size, n)
        _ring_reduce_scatter(mesh, out, ufunc, seq, segment_bytes, edges, acc, fill, scale)
        _ring_allgather(mesh, out, seq, segment_bytes, edges, done)


def uses_shm(mesh, nbytes, count) -> bool:
    """Whether :func:`allreduce` takes the shared-memory path for this buffer."""
    return (mesh.shm is not None and mesh.size > 1 and count >= mesh.size
            and (nbytes > SMALL_BYTES or barrier.uses_flags(mesh)))


def _shm_bounds(count, parts, dtype):
    """Chunks of a shared-memory slab: edges on 64-byte boundaries (a misaligned output halves
    the speed of numpy's vectorised reduce loops)."""
    return _bounds(count, parts, max(1, 64 // np.dtype(dtype).itemsize))


STAGED_PARTS = 2  # a fused bucket is packed (and announced) in this many parts per peer chunk
# mean bytes per array up to which allreduce_staged packs this rank's own chunk before reducing
# it (one ufunc pass instead of one per array: 100 x 4 KB, ~1 us per array saved)
_OWN_PIECE_BYTES = 64 << 10
_PACKED = 1 << 16  # barrier steps of allreduce_staged's parts: _PACKED + part


def allreduce_staged(mesh, count, pack, own, out, ufunc, seq, acc=None, scale=None, parts=STAGED_PARTS):
    """Allreduce a fusion bucket of ``count`` elements (at most one slab) through shared memory,
    packing it on the way: ``pack(dst, ranges)`` copies the bucket's element ``ranges`` into
    ``dst`` (this rank's staging half), ``own(lo, hi)`` returns ``(offset, array)`` pieces of the
    bucket's elements ``[lo, hi)``, read in place (this rank's own chunk is never copied, unless it
    holds many small arrays: then ``pack`` copies it into the part of this rank's half that
    nobody reads, and it is reduced in one pass).

    Each peer's chunk is packed in ``parts`` parts, each announced to the peers as soon as it is in
    shared memory (with this rank's ``out`` offset, as the first barrier of
    :func:`_shm_allreduce` does); each rank reduces its own chunk part by part as the peers'
    parts arrive.  A rank that packed first thus starts reducing while a slower one still packs,
    and the first barrier's latency hides behind packing.  Then as
    :func:`_shm_allreduce`: push into the peers' ``out`` (or copy out after the barrier)."""
    seg, n, r = mesh.shm, mesh.size, mesh.rank
    dtype = out.dtype
    half = seg.claim()
    edges = _shm_bounds(count, n, dtype)
    cuts = [[edges[q] + c for c in _shm_bounds(edges[q + 1] - edges[q], parts, dtype)] for q in range(n)]
    halves = [seg.half(q, half, dtype, count) for q in range(n)]
    peers = [q for q in range(n) if q != r]
    off = seg.pool_offset(out)
    tickets = []
    for j in range(parts):
        pack(halves[r], [(cuts[q][j], cuts[q][j + 1]) for q in peers])
        tickets.append(barrier.post(mesh, seq, _PACKED + j, -1 if off is None else off))
    lo, hi = edges[r], edges[r + 1]
    size, target, pushes = dtype.itemsize, None, []
    for j in range(parts):
        where = barrier.wait(mesh, tickets[j])
        if j == 0:
            direct = min(where) >= 0
            target = out[lo:hi] if direct else halves[r][lo:hi]
            pushes = [seg.at(q, where[q] + lo * size, dtype, hi - lo) for q in peers] if direct else []
        a, b = cuts[r][j], cuts[r][j + 1]
        mine = own(a, b)
        if len(mine) > 4 and (b - a) * size <= len(mine) * _OWN_PIECE_BYTES:
            pack(halves[r], [(a, b)])  # (many small arrays: one copy, then one reduction)
            mine = [(a, halves[r][a:b])]
        _reduce_chunk(ufunc, mine, lo, halves, peers, target, pushes, acc, scale)
    barrier.sync(mesh, seq, 1)
    if not direct:
        for q in range(n):
            np.copyto(out[edges[q]:edges[q + 1]], halves[q][edges[q]:edges[q + 1]])


def _shm_allreduce(mesh, inp, out, ufunc, seq, acc, scale=None, read=None, done=None):
    """Same-host allreduce through shared memory, one slab (<= half a segment) at a time.

    Per slab: (1) copy the chunks peers will reduce into my segment; barrier, which also tells
    every rank where each rank's ``out`` lies in its segment (-1: not in shared memory);
    (2) reduce my chunk from my input and the peers' segments; then either (direct: every
    rank's ``out`` is in its result pool) into my ``out`` and from there into every peer's
    ``out``, or into my segment; barrier; (3) unless direct, copy every rank's reduced chunk
    into ``out``.  Successive slabs (across calls too) alternate between the two halves of every
    segment, so slab g's first barrier proves every rank finished reading the half that slab
    g-2 used before anyone overwrites it.  A peer writes into my ``out`` only between the two
    barriers of a collective this rank is running, so a result is final once it is returned.

    ``read(dst, lo, hi)``, when given, copies input elements ``[lo, hi)`` into the host array
    ``dst`` (a device array staged straight into the segment: ``inp`` then only gives the dtype
    and size, and this rank's own chunk is staged into its target and reduced in place);
    ``done(lo, hi)`` is called as elements ``[lo, hi)`` of ``out`` are final, slab by slab."""
    seg, n, r = mesh.shm, mesh.size, mesh.rank
    slab = max(n, seg.slab_bytes // inp.dtype.itemsize)
    out_offset = seg.pool_offset(out)
    size = inp.dtype.itemsize
    peers = [q for q in range(n) if q != r]
    for k, start in enumerate(range(0, inp.size, slab)):
        m = min(slab, inp.size - start)
        edges = _shm_bounds(m, n, inp.dtype)
        lo, hi = edges[r], edges[r + 1]
        src = inp[start:start + m] if read is None else None
        half = seg.claim()
        halves = [seg.half(q, half, inp.dtype, m) for q in range(n)]
        mine = halves[r]
        for q in peers:
            if read is None:
                np.copyto(mine[edges[q]:edges[q + 1]], src[edges[q]:edges[q + 1]])
            else:
                read(mine[edges[q]:edges[q + 1]], start + edges[q], start + edges[q + 1])
        where = barrier.sync(mesh, seq, 2 * k, -1 if out_offset is None else out_offset + start * size)
        direct = min(where) >= 0
        dst = out[start:start + m]
        target = dst[lo:hi] if direct else mine[lo:hi]
        if read is None:
            own = src[lo:hi]
        else:
            read(target, start + lo, start + hi)
            own = target
        pushes = [seg.at(q, where[q] + lo * size, inp.dtype, hi - lo) for q in peers] if direct else []
        _reduce_chunk(ufunc, [(lo, own)], lo, halves, peers, target, pushes, acc, scale)
        barrier.sync(mesh, seq, 2 * k + 1)
        if not direct:
            for q in range(n):
                np.copyto(dst[edges[q]:edges[q + 1]], halves[q][edges[q]:edges[q + 1]])
        if done is not None:
            done(start, start + m)


def allreduce_hierarchical(hier, inp, out, ufunc, seq, segment_bytes, acc=None, scale=None):
    """:func:`allreduce` across hosts, as Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``: the
    ranks of each host reduce-scatter through shared memory, each rank allreduces the parts it
    owns with their owners on the other hosts (:class:`sdp.engine.groups.Hierarchy`: cross
    groups, over ZeroMQ, all in parallel, so a host's link carries 1/local_size of the buffer
    per rank), then the owners write the results into every local rank's output (an allgather
    through shared memory).  Same arguments and results as :func:`allreduce` (bit-identical on
    every rank: each part is reduced by one rank per host and the cross allreduce gives its
    members identical bits).

    One slab (<= half a segment) at a time, as :func:`_shm_allreduce`: (1) copy the parts other
    local ranks own into my half; barrier (with every rank's ``out`` offset); (2) for each part I
    own: allreduce it across hosts, reducing it from my input and the local peers' halves as the
    cross ring sends it (``fill``) and copying each final segment into every local peer's ``out``
    as it arrives (``done``; direct) or leaving it in my half; barrier; (3) unless direct, copy
    the other parts from their owners' halves.  A rank alone on its host skips the shared memory.  16-bit sums of an average are scaled in
    float32 in (2) before they are rounded (the flat ring scales contributions likewise)."""
    host = hier.host
    pre = acc is not None and scale is not None and ufunc is np.add
    host_scale, cross_scale = (scale, None) if pre else (None, scale)
    if out is not inp and (host.shm is None or inp.size == 0):
        np.copyto(out, inp)
    if inp.size == 0:
        if scale is not None:
            scale_in_place(out, scale)
        return
    hier.allreduces += 1
    nparts, size = hier.nparts, inp.dtype.itemsize
    seg, r = host.shm, host.rank
    peers = [q for q in range(host.size) if q != r]
    # the same slabs and parts on every host (a part's owners allreduce it together)
    slab = max(nparts, hier.slab_bytes // size) if hier.slab_bytes > 0 else inp.size
    out_offset = None if seg is None else seg.pool_offset(out)
    for k, start in enumerate(range(0, inp.size, slab)):
        m = min(slab, inp.size - start)
        edges = _shm_bounds(m, nparts, inp.dtype)
        src, dst = inp[start:start + m], out[start:start + m]
        if seg is None:  # alone on this host: every part is mine, and out holds my input
            for j in hier.parts:
                part = dst[edges[j]:edges[j + 1]]
                if host_scale is not None:
                    wide = part.astype(acc)
                    np.multiply(wide, host_scale, out=wide)
                    part[...] = wide
                allreduce(hier.cross[j], part, part, ufunc, seq, segment_bytes, acc, cross_scale)
            continue
        half = seg.claim()
        halves = [seg.half(q, half, inp.dtype, m) for q in range(host.size)]
        mine = halves[r]
        for j in range(nparts):
            if hier.owner[j] != r:
                np.copyto(mine[edges[j]:edges[j + 1]], src[edges[j]:edges[j + 1]])
        where = barrier.sync(host, seq, 2 * k, -1 if out_offset is None else out_offset + start * size)
        direct = min(where) >= 0
        for j in hier.parts:
            lo, hi = edges[j], edges[j + 1]
            target = dst[lo:hi] if direct else mine[lo:hi]

            def fill(a, b, lo=lo, target=target):  # reduced on demand: overlaps the first sends
                _reduce_chunk(ufunc, [(lo + a, src[lo + a:lo + b])], lo + a, halves, peers, target[a:b], [],
                              acc, host_scale)

            pushes = [seg.at(q, where[q] + lo * size, inp.dtype, hi - lo) for q in peers] if direct else []

            def done(a, b, target=target, pushes=pushes):  # final: into the local peers' out at once
                for p in pushes:
                    np.copyto(p[a:b], target[a:b])

            allreduce(hier.cross[j], target, target, ufunc, seq, segment_bytes, acc, cross_scale, fill, done)
            if not direct:
                np.copyto(dst[lo:hi], target)
        barrier.sync(host, seq, 2 * k + 1)
        if not direct:
            for j in range(nparts):
                if hier.owner[j] != r:
                    np.copyto(dst[edges[j]:edges[j + 1]], halves[hier.owner[j]][edges[j]:edges[j + 1]])


def _reduce_chunk(ufunc, pieces, lo, halves, peers, target, pushes, acc, scale):
    """Reduce the ``(offset, array)`` ``pieces`` of this rank's chunk (which starts at element
    ``lo`` of the slab) with the peers' ``halves`` into ``target`` and copy each block into every
    array in ``pushes`` (``target`` and ``pushes`` are indexed from ``lo``).  Block by block, so a
    block pushed to the peers is read from cache; 16-bit floats accumulate and scale in float32
    (``acc``) and round once."""
    tmp = None if acc is None else np.empty(min(sum(p.size for _, p in pieces), _BLOCK), acc)
    for off, piece in _blocks(pieces):
        a, b = off - lo, off - lo + piece.size
        t = target[a:b] if acc is None else tmp[:b - a]
        ufunc(piece, halves[peers[0]][off:off + piece.size], out=t, dtype=acc)
        for q in peers[1:]:
            ufunc(t, halves[q][off:off + piece.size], out=t, dtype=acc)
        if scale is not None:
            np.multiply(t, scale, out=t, casting="unsafe")
        if acc is not None:
            target[a:b] = t
        for p in pushes:
            np.copyto(p[a:b], target[a:b])


def reduce_copies(ufunc, copies, out, acc, scale) -> None:
    """Reduce every rank's copy (``copies``, 1-D, in rank order) into ``out``, in rank order, as
    the shared-memory chunk reduction does: the same bits wherever it runs (the fast lane on every
    rank, rank 0 for :mod:`sdp.engine.inline`)."""
    if acc is not None or out.size > _BLOCK:
        _reduce_chunk(ufunc, [(0, copies[0])], 0, copies, range(1, len(copies)), out, [], acc, scale)
        return
    ufunc(copies[0], copies[1], out=out)  # (one block: the same operations, ~1 us less)
    for c in copies[2:]:
        ufunc(out, c, out=out)
    if scale is not None:
        np.multiply(out, scale, out=out, casting="unsafe")


_BLOCK = 128 * 1024  # elements reduced (and pushed to the peers) at a time: stays in L2 cache


def _blocks(pieces):
    """``(offset, array)`` pieces split into blocks of at most ``_BLOCK`` elements."""
    for off, piece in pieces:
        for s in range(0, piece.size, _BLOCK):
            yield off + s, piece[s:s + _BLOCK]


def _combine(ufunc, mine, theirs, acc, scale=None):
    """``mine = ufunc(mine, theirs)``, then times ``scale`` if given (the last step of a
    reduction); 16-bit floats are computed in ``acc`` (float32) and rounded once, after scaling."""
    if acc is None:
        ufunc(mine, theirs, out=mine)
        if scale is not None:
            np.multiply(mine, scale, out=mine, casting="unsafe")
    else:  # the ufunc casts in buffered blocks, ~2.5x faster than astype
        tmp = np.empty(mine.shape, acc)
        ufunc(mine, theirs, out=tmp, dtype=acc)
        if scale is not None:
            np.multiply(tmp, scale, out=tmp)
        mine[...] = tmp


def _recursive_doubling(mesh, buf, ufunc, seq, acc, scale=None):
    n, r = mesh.size, mesh.rank
    p = 1 << (n.bit_length() - 1)  # largest power of two <= n
    w = _Wire(mesh, seq, max(buf.nbytes, 1), buf.dtype)
    # fold ranks >= p into rank - p
    if r >= p:
        w.send(r - p, buf)
    elif r + p < n:
        for _, seg in w.recv_each(r + p, buf.size):
            _combine(ufunc, buf, seg, acc)
    if r < p:
        mask = 1
        while mask < p:
            partner = r ^ mask
            w.send(partner, buf)
            for _, seg in w.recv_each(partner, buf.size):
                w.finish()  # our send must have left ``buf`` before we overwrite it
                # both partners compute a op b with a, b swapped: IEEE add/mul/min/max are
                # commutative, so every rank ends with identical bits
                _combine(ufunc, buf, seg, acc, scale if mask << 1 == p else None)
            mask <<= 1
        if r + p < n:
            w.send(r + p, buf)
    else:
        for _, seg in w.recv_each(r - p, buf.size):
            buf[...] = seg
    w.finish()


def _ring_reduce_scatter(mesh, buf, ufunc, seq, segment_bytes, edges, acc, fill=None, scale=None):
    """After this, rank r holds the full reduction of chunk r (``edges[r]:edges[r+1]``), times
    ``scale`` if given (applied in the last step, before 16-bit floats are rounded; the partial
    sums of earlier steps, with more than 2 ranks, travel rounded to 16 bits).
    ``fill``: see :func:`allreduce` (the first chunk sent is filled and sent segment by segment,
    then the rest of ``buf`` is filled)."""
    n, r = mesh.size, mesh.rank
    right, left = (r + 1) % n, (r - 1) % n
    w = _Wire(mesh, seq, segment_bytes, buf.dtype)
    for step in range(n - 1):
        si, ri = (r - step - 1) % n, (r - step - 2) % n
        lo, hi = edges[si], edges[si + 1]
        if step == 0 and fill is not None:
            for s in range(lo, hi, w.seg):
                fill(s, min(s + w.seg, hi))
                w.send(right, buf[s:min(s + w.seg, hi)])
            fill(0, lo)
            fill(hi, buf.size)
        else:
            w.send(right, buf[lo:hi])
        chunk = buf[edges[ri]:edges[ri + 1]]
        for s, seg in w.recv_each(left, chunk.size):
            _combine(ufunc, chunk[s:s + seg.size], seg, acc, scale if step == n - 2 else None)
    w.finish()


def _ring_allgather(mesh, buf, seq, segment_bytes, edges, done=None):
    """Rank r starts owning chunk r; afterwards every rank has every chunk.  ``done(lo, hi)``:
    called for chunk r first, then for each segment as it arrives."""
    _ring_allgather_spans(mesh, buf, seq, segment_bytes, [[(edges[q], edges[q + 1])] for q in range(mesh.size)],
                          done)


def _ring_allgather_spans(mesh, buf, seq, segment_bytes, spans, done=None):
    """:func:`_ring_allgather` where rank q owns the element ranges ``spans[q]`` (a list of
    ``(lo, hi)``, possibly empty) instead of one chunk."""
    n, r = mesh.size, mesh.rank
    right, left = (r + 1) % n, (r - 1) % n
    w = _Wire(mesh, seq, segment_bytes, buf.dtype)
    if done is not None:
        for lo, hi in spans[r]:
            done(lo, hi)
    for step in range(n - 1):
        si, ri = (r - step) % n, (r - step - 1) % n
        for lo, hi in spans[si]:
            w.send(right, buf[lo:hi])
        for lo, hi in spans[ri]:
            chunk = buf[lo:hi]
            for s, seg in w.recv_each(left, chunk.size):
                chunk[s:s + seg.size] = seg
                if done is not None:
                    done(lo + s, lo + s + seg.size)
    w.finish()


def reducescatter(mesh, buf, ufunc, seq, segment_bytes, edges, acc=None, scale=None):
    """Reduce ``buf`` so that rank r's range ``edges[r]:edges[r+1]`` holds the full result, times
    ``scale`` if given (applied before 16-bit floats are rounded, as :func:`allreduce` does)."""
    if mesh.size > 1 and buf.size:
        _ring_reduce_scatter(mesh, buf, ufunc, seq, segment_bytes, edges, acc, None, scale)
    elif scale is not None:
        scale_in_place(buf, scale)


def allgatherv(mesh, out, edges, seq, segment_bytes):
    """``out`` holds this rank's block at ``edges[rank]:edges[rank+1]``; fill in all others."""
    if mesh.size > 1 and out.size:
        _ring_allgather(mesh, out, seq, segment_bytes, edges)


def allgatherv_hierarchical(hier, out, edges, seq, segment_bytes):
    """:func:`allgatherv` across hosts: first each cross group (:class:`sdp.engine.groups.Hierarchy`,
    the ranks of column ``j``) gathers the blocks of the ranks with local rank ``j`` on every
    host (a host with fewer ranks adds none), then each host's ranks gather what their columns
    brought among themselves.  A host's link carries (H-1)/H of the result, against
    (n-1)/n on the flat ring's cross-host edges.  Same arguments and result as :func:`allgatherv`."""
    if out.size == 0:
        return
    hier.allgathers += 1
    members = hier.members
    block = [(edges[g], edges[g + 1]) for g in range(len(edges) - 1)]
    for j in hier.parts:
        _ring_allgather_spans(hier.cross[j], out, seq, segment_bytes,
                              [[block[m[j]]] if j < len(m) else [] for m in members])
    host = hier.host
    if host.size > 1:  # column j's blocks came to local rank j % L
        column = {g: i for m in members for i, g in enumerate(m)}
        _ring_allgather_spans(host, out, seq, segment_bytes,
                              [[block[g] for g in range(len(block)) if column[g] % host.size == q]
                               for q in range(host.size)])


def broadcast(mesh, buf, root, seq, segment_bytes):
    """Copy ``root``'s ``buf`` into every rank's ``buf`` along a binomial tree."""
    n = mesh.size
    if n == 1:
        return
    vr = (mesh.rank - root) % n  # virtual rank: root is 0
    w = _Wire(mesh, seq, segment_bytes, buf.dtype)
    mask = 1
    while mask < n:  # receive from parent
        if vr & mask:
            parent = ((vr - mask) + root) % n
            for s, seg in w.recv_each(parent, buf.size):
                buf[s:s + seg.size] = seg
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:  # send to children
        if vr + mask < n:
            w.send((vr + mask + root) % n, buf)
        mask >>= 1
    w.finish()


def alltoallv(mesh, send, send_edges, recv, recv_edges, seq, segment_bytes):
    """Send ``send[send_edges[j]:send_edges[j+1]]`` to rank j; receive rank j's block for us into
    ``recv[recv_edges[j]:recv_edges[j+1]]``.  Pairwise exchange in n-1 steps."""
    n, r = mesh.size, mesh.rank
    recv[recv_edges[r]:recv_edges[r + 1]] = send[send_edges[r]:send_edges[r + 1]]
    w = _Wire(mesh, seq, segment_bytes, send.dtype)
    for step in range(1, n):
        dst, src = (r + step) % n, (r - step) % n
        w.send(dst, send[send_edges[dst]:send_edges[dst + 1]])
        block = recv[recv_edges[src]:recv_edges[src + 1]]
        for s, seg in w.recv_each(src, block.size):
            block[s:s + seg.size] = seg
    w.finish()
