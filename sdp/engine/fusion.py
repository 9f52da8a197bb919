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


class FusionBuffer:
    """A preallocated byte buffer reused for every fused bucket (grown only if the threshold grows)."""

    def __init__(self, nbytes: int):
        self._raw = np.empty(max(nbytes, 0), dtype=np.uint8)

    def view(self, dtype, count: int) -> np.ndarray:
        need = count * np.dtype(dtype).itemsize
        if need > self._raw.nbytes:
            self._raw = np.empty(need, dtype=np.uint8)
        return self._raw[:need].view(dtype)


def pack(buf: np.ndarray, arrays: List[np.ndarray]) -> List[int]:
    """Copy each array into consecutive ranges of ``buf``; return the element offsets (len+1)."""
    offsets = [0]
    for a in arrays:
        n = a.size
        np.copyto(buf[offsets[-1]:offsets[-1] + n], a.reshape(-1))
        offsets.append(offsets[-1] + n)
    return offsets
