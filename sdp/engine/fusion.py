"""Tensor fusion: pack many small allreduces into one buffer and reduce them in one collective.

Buckets are formed from the agreed response list, which is identical on every rank, so every rank
forms the same buckets: consecutive-in-order allreduce items with the same dtype, op and scale
factors, up to ``threshold`` bytes (SMDDP's ``bucket_cap_mb``, default 25 MB).
"""
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
    ``ranges`` (``[(start, end), ...]`` of the packed layout).  Padding is left as it is."""
    for lo, hi in ranges if ranges is not None else [(0, offs[-1])]:
        for off, view in pieces(arrays, offs, lo, hi):
            np.copyto(buf[off:off + view.size], view)


def zero_padding(buf: np.ndarray, arrays: List[np.ndarray], offs: List[int]) -> None:
    """Set the padding between the arrays' places in ``buf`` to 0 (so that a reduction over the
    whole buffer never computes on leftover bytes)."""
    for a, start, nxt in zip(arrays, offs, offs[1:]):
        if start + a.size < nxt:
            buf[start + a.size:nxt] = 0


def pieces(arrays: List[np.ndarray], offs: List[int], lo: int, hi: int):
    """``(offset, view)`` pairs of the arrays' elements in ``[lo, hi)`` of the packed layout."""
    out = []
    for a, start in zip(arrays, offs):
        s, e = max(start, lo), min(start + a.size, hi)
        if s < e:
            out.append((s, a.reshape(-1)[s - start:e - start]))
    return out


def flatten(arrays: List[np.ndarray]):
    """``(flat, parts)``: ``arrays`` (one dtype, any shapes) packed into one new aligned 1-D
    array at :func:`offsets` (padding zeroed), and ``parts``, each array's ``(offset, size,
    shape)`` there, for :func:`unflatten`.  One copy of the bytes: the one fusion makes anyway."""
    offs = offsets(arrays)
    flat = aligned_empty(arrays[0].dtype, offs[-1])
    pad = np.zeros(max(1, ALIGN_BYTES // flat.itemsize), flat.dtype)
    chunks = []  # (one concatenate: ~0.2 us per array, where a copy each costs ~1.5 us)
    for a, start, nxt in zip(arrays, offs, offs[1:]):
        chunks.append(a.ravel())
        if start + a.size < nxt:
            chunks.append(pad[:nxt - start - a.size])
    np.concatenate(chunks, out=flat)
    return flat, [(off, a.size, a.shape) for a, off in zip(arrays, offs)]


def unflatten(flat: np.ndarray, parts) -> List[np.ndarray]:
    """Views of the ``parts`` (from :func:`flatten`) of the 1-D array ``flat``, no copy."""
    return [flat[off:off + size].reshape(shape) for off, size, shape in parts]


def aligned_empty(dtype, count: int, align_bytes: int = ALIGN_BYTES) -> np.ndarray:
    """A new 1-D array of ``count`` elements of ``dtype`` whose data starts on an ``align_bytes``
    boundary (numpy's own arrays are only 16-byte aligned)."""
    dtype = np.dtype(dtype)
    raw = np.empty(count * dtype.itemsize + align_bytes, np.uint8)
    skip = -raw.ctypes.data % align_bytes
    return raw[skip:skip + count * dtype.itemsize].view(dtype)
