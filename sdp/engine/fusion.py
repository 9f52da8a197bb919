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


def offsets(arrays: List[np.ndarray]) -> List[int]:
    """Element offsets of ``arrays`` laid end to end (len(arrays) + 1 entries)."""
    out = [0]
    for a in arrays:
        out.append(out[-1] + a.size)
    return out


def pack(buf: np.ndarray, arrays: List[np.ndarray], offs: List[int], ranges=None) -> None:
    """Copy the arrays into ``buf`` at their offsets: all of them, or only the element ranges
    ``ranges`` (``[(start, end), ...]`` of the packed layout)."""
    for lo, hi in ranges if ranges is not None else [(0, offs[-1])]:
        for off, view in pieces(arrays, offs, lo, hi):
            np.copyto(buf[off:off + view.size], view)


def pieces(arrays: List[np.ndarray], offs: List[int], lo: int, hi: int):
    """``(offset, view)`` pairs of the arrays' elements in ``[lo, hi)`` of the packed layout."""
    out = []
    for a, start, end in zip(arrays, offs, offs[1:]):
        s, e = max(start, lo), min(end, hi)
        if s < e:
            out.append((s, a.reshape(-1)[s - start:e - start]))
    return out
