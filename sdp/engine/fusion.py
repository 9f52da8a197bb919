"""Tensor fusion: pack many small allreduces into one buffer and reduce them in one collective.

Buckets are formed from the agreed response list, which is identical on every rank, so every rank
forms the same buckets: consecutive-in-order allreduce items with the same dtype, op and scale
factors, up to ``threshold`` bytes (SMDDP's ``bucket_cap_mb``, default 25 MB).
"""
import bisect
import sys
import threading
from typing import Dict, List

import numpy as np


def plan_buckets(items: List[dict], nbytes: Dict[str, int], key, threshold: int) -> List[List[dict]]:
    """Group ``items`` (in order) into buckets of equal ``key(item)`` totalling <= ``threshold`` bytes.

    An item larger than ``threshold`` (or any item when ``threshold`` is 0) is a bucket of its own.
    """
    buckets: List[List[dict]] = []
    open_: Dict[object, int] = {}  # key -> index of the bucket still accepting items
    fill: Dict[int, int] = {}
    for item in items:
        size, k = nbytes[item["n"]], key(item)
        i = open_.get(k)
        if threshold and i is not None and fill[i] + size <= threshold:
            buckets[i].append(item)
            fill[i] += size
            continue
        buckets.append([item])
        fill[len(buckets) - 1] = size
        if threshold and size < threshold:
            open_[k] = len(buckets) - 1
    return buckets


def runs(items: list, nbytes: List[int], threshold: int) -> List[list]:
    """``items`` (in order) in runs of consecutive items totalling <= ``threshold`` bytes
    (``nbytes``: each item's bytes): a caller's buckets before the engine sees them.  0 (no
    fusion) gives one item per run; an item larger than ``threshold`` is a run alone."""
    out, fill = [], 0
    for item, n in zip(items, nbytes):
        if not out or not threshold or fill + n > threshold:
            out.append([])
            fill = 0
        out[-1].append(item)
        fill += n
    return out


ALIGN_BYTES = 64  # every tensor of a bucket starts on this boundary (TensorFlow's EIGEN_MAX_ALIGN_BYTES)


def offsets(arrays: List[np.ndarray], align_bytes: int = ALIGN_BYTES) -> List[int]:
    """Element offsets of ``arrays`` (one dtype) laid end to end, each start rounded up to a
    multiple of ``align_bytes`` bytes; ``len(arrays) + 1`` entries, the last one the total size,
    padding included.  A result array aligned on ``align_bytes`` thus gives every tensor an
    aligned view (TensorFlow wraps only such memory without a copy, see ``sdp.tensorflow.ops``)."""
    unit = max(1, align_bytes // arrays[0].dtype.itemsize) if arrays else 1
    out = [0]
    for a in arrays:
        out.append(-(-(out[-1] + a.size) // unit) * unit)
    if arrays:
        out[-1] = out[-2] + arrays[-1].size  # no padding after the last one
    return out


def pack(buf: np.ndarray, arrays: List[np.ndarray], offs: List[int], ranges=None) -> None:
    """Copy the arrays into ``buf`` at their offsets: all of them, or only the element ranges
    ``ranges`` (``[(start, end), ...]`` of the packed layout), padding inside a range zeroed.
    One ``concatenate`` per range (a copy per array cost ~1.5 us each: 100 x 4 KB took 124 us)."""
    for lo, hi in ranges if ranges is not None else [(0, offs[-1])]:
        chunks, pos, zeros = [], lo, None
        for off, view in pieces(arrays, offs, lo, hi) + [(hi, None)]:
            if off > pos:  # (padding: less than ALIGN_BYTES)
                zeros = np.zeros(ALIGN_BYTES, buf.dtype) if zeros is None else zeros
                chunks.append(zeros[:off - pos])
            if view is not None:
                chunks.append(view)
                pos = off + view.size
        if chunks:
            np.concatenate(chunks, out=buf[lo:hi])


def zero_padding(buf: np.ndarray, arrays: List[np.ndarray], offs: List[int]) -> None:
    """Set the padding between the arrays' places in ``buf`` to 0 (so that a reduction over the
    whole buffer never computes on leftover bytes)."""
    for a, start, nxt in zip(arrays, offs, offs[1:]):
        if start + a.size < nxt:
            buf[start + a.size:nxt] = 0


def pieces(arrays: List[np.ndarray], offs: List[int], lo: int, hi: int):
    """``(offset, view)`` pairs of the arrays' elements in ``[lo, hi)`` of the packed layout
    (1-D views, in order; only the arrays there are looked at)."""
    out = []
    i = max(0, bisect.bisect_right(offs, lo) - 1)  # (the last array starting at or before lo)
    n = len(arrays)
    while i < n and offs[i] < hi:
        a, start = arrays[i], offs[i]
        end = start + a.size
        if a.ndim != 1:
            a = a.reshape(-1)
        if lo <= start and end <= hi:  # (whole: most of them)
            if end > start:
                out.append((start, a))
        elif start < hi and lo < end:
            s = max(start, lo)
            out.append((s, a[s - start:min(end, hi) - start]))
        i += 1
    return out


def compiled():
    """The fast lane's C extension if this process loaded it (``sdp.engine.native``), else None
    (nothing is built or imported here)."""
    native = sys.modules.get("sdp.engine.native")
    return None if native is None else native.loaded()


class Layout:
    """Where each array of a flattened group lies in one aligned 1-D buffer of ``dtype``: at
    ``offsets`` (padding zeroed), so that every part is an aligned view.  Built once per group
    shape (callers cache it: a training step submits the same group every step); ``pack``
    copies arrays into such a buffer, ``views`` gives the parts of a result back.  ``shapes``: every array's
    shape, in order (what ranks must agree on); ``count``: the buffer's elements; ``starts``: each
    array's element offset in it (a tuple); ``spans``: each array's (start, end, shape or None
    where a 1-D slice has it) in it, what ``views`` cuts."""

    __slots__ = ("dtype", "shapes", "count", "starts", "spans", "_seq", "_pads")

    def __init__(self, arrays: List[np.ndarray]):
        offs = offsets(arrays)
        self.dtype = arrays[0].dtype
        self.shapes = tuple(a.shape for a in arrays)
        self.count = offs[-1]
        self.spans = [(start, start + a.size, None if a.shape == (a.size,) else a.shape)
                      for a, start in zip(arrays, offs)]
        self.starts = tuple(offs[:-1])
        self._pads = {}  # -(k + 1) -> k zeros (padding of k elements), in self._seq as that key
        seq = []
        for i, (a, start, nxt) in enumerate(zip(arrays, offs, offs[1:])):
            seq.append(i)
            if start + a.size < nxt:
                k = nxt - start - a.size
                self._pads.setdefault(-(k + 1), np.zeros(k, self.dtype))
                seq.append(-(k + 1))
        self._seq = seq if self._pads else None  # (None: the arrays lie end to end)

    def pack(self, arrays: List[np.ndarray], out: np.ndarray) -> None:
        """Copy ``arrays`` (this layout's shapes and dtype) into ``out`` (1-D, ``count``
        elements of ``dtype``), padding zeroed: one ``concatenate`` (~0.2 us per array,
        where a copy each costs ~1.5 us; with the compiled step loaded, a copy each in C:
        100 x 4 KB ~11 instead of ~25 us)."""
        step = compiled()
        if step is not None and type(arrays) is list and step.pack(arrays, out, self.starts):
            return
        if self._seq is None:
            np.concatenate(arrays, axis=None, out=out)
        else:
            pads = self._pads
            np.concatenate([arrays[i] if i >= 0 else pads[i] for i in self._seq], axis=None, out=out)

    def views(self, flat: np.ndarray) -> List[np.ndarray]:
        """Views of every part of the 1-D array ``flat`` (a buffer of this layout), no copy
        (made in C with the compiled step loaded: 100 views ~6 instead of ~19 us)."""
        step = compiled()
        if step is not None:
            return step.views(flat, self.spans)
        return [flat[a:b] if shape is None else flat[a:b].reshape(shape) for a, b, shape in self.spans]


SMALL_BYTES = 4096  # arrays of at most this many bytes are carved out of a shared chunk
_CHUNK_BYTES = 64 << 10
_chunks = threading.local()  # this thread's (chunk, bytes of it handed out)


def aligned_empty(dtype, count: int, align_bytes: int = ALIGN_BYTES) -> np.ndarray:
    """A new 1-D array of ``count`` elements of ``dtype`` whose data starts on an ``align_bytes``
    boundary (numpy's own arrays are only 16-byte aligned).  Arrays of at most
    ``SMALL_BYTES`` are views of a 64 KB chunk that this thread carves in turn (finding an
    address costs ~1 us, as much as the rest of a 1 KB allreduce's result); a chunk is freed
    once every array of it is."""
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    if nbytes <= SMALL_BYTES and align_bytes == ALIGN_BYTES:
        chunk, used = getattr(_chunks, "at", (None, 0))
        if chunk is None or used + nbytes > _CHUNK_BYTES:
            chunk, used = _aligned_raw(_CHUNK_BYTES, ALIGN_BYTES), 0
        _chunks.at = (chunk, used + -(-max(nbytes, 1) // ALIGN_BYTES) * ALIGN_BYTES)
        return chunk[used:used + nbytes].view(dtype)
    step = compiled() if align_bytes == ALIGN_BYTES else None
    if step is not None:  # (~0.6 us where the lines below take ~3: the address from Python is most of it)
        return step.aligned_empty(dtype, count)
    return _aligned_raw(nbytes, align_bytes).view(dtype)


def _aligned_raw(nbytes: int, align_bytes: int) -> np.ndarray:
    raw = np.empty(nbytes + align_bytes, np.uint8)
    skip = -raw.ctypes.data % align_bytes
    return raw[skip:skip + nbytes]
