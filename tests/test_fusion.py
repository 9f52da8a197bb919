"""Fusion-buffer layout (no sockets): bucket plans, packing given element ranges, in-place pieces."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp.engine import fusion


def test_plan_buckets_caps_bytes_and_splits_by_key():
    items = [{"n": f"t{i}", "k": "f" if i != 2 else "h"} for i in range(5)]
    nbytes = {"t0": 40, "t1": 40, "t2": 10, "t3": 30, "t4": 200}
    buckets = fusion.plan_buckets(items, nbytes, lambda it: it["k"], 100)
    assert [[it["n"] for it in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert len(fusion.plan_buckets(items, nbytes, lambda it: it["k"], 0)) == 5  # 0: no fusion


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=8),
       cuts=st.lists(st.integers(0, 400), max_size=6))
def test_pack_copies_exactly_the_given_ranges(sizes, cuts):
    arrays = [np.arange(s, dtype=np.float32) + 1000 * i for i, s in enumerate(sizes)]
    offs = fusion.offsets(arrays)
    total = offs[-1]
    flat = np.concatenate(arrays) if total else np.zeros(0, np.float32)
    edges = sorted({0, total} | {min(c, total) for c in cuts})
    ranges = list(zip(edges[::2], edges[1::2]))  # every other interval
    buf = np.full(total, -1.0, np.float32)
    fusion.pack(buf, arrays, offs, ranges)
    want = np.full(total, -1.0, np.float32)
    for lo, hi in ranges:
        want[lo:hi] = flat[lo:hi]
    assert np.array_equal(buf, want)
    whole = np.empty(total, np.float32)
    fusion.pack(whole, arrays, offs)
    assert np.array_equal(whole, flat)
    for lo, hi in ranges:  # pieces are views of the arrays, covering [lo, hi) in order
        got = fusion.pieces(arrays, offs, lo, hi)
        assert all(any(np.shares_memory(v, a) for a in arrays) for _, v in got)
        assert [off for off, _ in got] == sorted(off for off, _ in got)
        assert np.array_equal(np.concatenate([v for _, v in got]) if got else flat[lo:lo], flat[lo:hi])
