"""Fusion-buffer layout (no sockets): bucket plans, packing given element ranges (padding inside them
zeroed, nothing outside them touched), in-place pieces."""
import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp.engine import fusion, native


def test_plan_buckets_caps_bytes_and_splits_by_key():
    items = [{"n": f"t{i}", "k": "f" if i != 2 else "h"} for i in range(5)]
    nbytes = {"t0": 40, "t1": 40, "t2": 10, "t3": 30, "t4": 200}
    buckets = fusion.plan_buckets(items, nbytes, lambda it: it["k"], 100)
    assert [[it["n"] for it in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert len(fusion.plan_buckets(items, nbytes, lambda it: it["k"], 0)) == 5  # 0: no fusion


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=8),
       cuts=st.lists(st.integers(0, 400), max_size=6),
       dtype=st.sampled_from([np.float32, np.float64, np.int8, np.float16]))
def test_pack_copies_exactly_the_given_ranges(sizes, cuts, dtype):
    arrays = [(np.arange(s) % 50 + 60 * i).astype(dtype) for i, s in enumerate(sizes)]
    offs = fusion.offsets(arrays)
    unit = 64 // np.dtype(dtype).itemsize
    assert all(o % unit == 0 for o in offs[:-1]), offs  # every tensor starts on 64 bytes
    assert all(o + a.size <= nxt < o + a.size + unit for a, o, nxt in zip(arrays, offs, offs[1:-1])), offs
    total = offs[-1]
    assert total == offs[-2] + arrays[-1].size  # no padding after the last tensor
    flat = np.zeros(total, dtype)  # the layout: each array at its offset, padding zeroed
    covered = np.zeros(total, bool)
    for a, o in zip(arrays, offs):
        flat[o:o + a.size] = a
        covered[o:o + a.size] = True
    edges = sorted({0, total} | {min(c, total) for c in cuts})
    ranges = list(zip(edges[::2], edges[1::2]))  # every other interval
    buf = np.full(total, -1, dtype)
    fusion.pack(buf, arrays, offs, ranges)
    want = np.full(total, -1, dtype)
    for lo, hi in ranges:
        want[lo:hi] = flat[lo:hi]
    assert np.array_equal(buf, want)
    whole = np.full(total, -1, dtype)
    fusion.pack(whole, arrays, offs)
    assert np.array_equal(whole, flat)
    padded = np.full(total, 7, dtype)
    fusion.zero_padding(padded, arrays, offs)
    assert np.array_equal(padded, np.where(covered, 7, 0).astype(dtype))
    for lo, hi in ranges:  # pieces are views of the arrays, covering their elements in [lo, hi) in order
        got = fusion.pieces(arrays, offs, lo, hi)
        assert all(any(np.shares_memory(v, a) for a in arrays) for _, v in got)
        assert [off for off, _ in got] == sorted(off for off, _ in got)
        expect = flat[lo:hi][covered[lo:hi]]
        assert np.array_equal(np.concatenate([v for _, v in got]) if got else expect[:0], expect)


@pytest.mark.parametrize("compiled", [True, False])
@settings(deadline=None)
@given(count=st.integers(0, 5000), dtype=st.sampled_from([np.float32, np.float64, np.int8, np.float16, np.int64]))
def test_aligned_empty_starts_on_64_bytes(compiled, count, dtype):
    with _compiled_step(compiled):  # (the compiled step's allocation too, where it is loaded)
        a = fusion.aligned_empty(dtype, count)
        b = fusion.aligned_empty(dtype, count)
    assert a.shape == (count,) and a.dtype == dtype and a.flags.writeable and a.flags.c_contiguous
    assert count == 0 or a.ctypes.data % 64 == 0  # (an empty array has no data to align)
    a[...], b[...] = 1, 2  # two arrays never share memory, and each keeps its own alive
    del b
    assert np.all(a == 1)


def test_the_compiled_allocation_refuses_bad_arguments():
    with _compiled_step(True):
        step = native.loaded()
        for args, error in [((np.float32, -1), ValueError), (("no such dtype", 4), TypeError),
                            ((np.float32,), TypeError), ((np.float32, "4"), TypeError)]:
            with pytest.raises(error):
                step.aligned_empty(*args)


@given(counts=st.lists(st.integers(0, 1500), min_size=1, max_size=80))
def test_small_aligned_arrays_never_overlap(counts):
    arrays = [fusion.aligned_empty(np.float32, c) for c in counts]  # (many from one chunk, some from the next)
    for i, a in enumerate(arrays):
        a[...] = i
    assert all(np.all(a == i) for i, a in enumerate(arrays))
    assert all(a.ctypes.data % 64 == 0 for a in arrays if a.size)


@contextlib.contextmanager
def _compiled_step(on: bool):
    """The fast lane's C extension loaded in this process (``on``; skipped where it cannot be
    built), or set aside: fusion.Layout packs and views in C only when it is loaded."""
    saved = native._state.get("module", _UNSET)
    if on and native.load() is None:
        pytest.skip("the compiled step cannot be built here")
    if not on:
        native._state["module"] = None
    try:
        yield
    finally:
        if saved is _UNSET:
            native._state.pop("module", None)
        else:
            native._state["module"] = saved


_UNSET = object()


@pytest.mark.parametrize("compiled", [True, False])
@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.sampled_from([(), (0,), (1,), (3,), (16,), (5, 7), (2, 1, 3), (33,)]), min_size=1,
                       max_size=10),
       dtype=st.sampled_from([np.float32, np.float64, np.int8, np.float16]))
def test_layout_packs_at_the_offsets_and_gives_the_parts_back(compiled, shapes, dtype):
    with _compiled_step(compiled):
        _layout_round_trip(shapes, dtype)


def _layout_round_trip(shapes, dtype):
    arrays = [(np.arange(int(np.prod(s))) + 100 * i).astype(dtype).reshape(s) for i, s in enumerate(shapes)]
    layout = fusion.Layout(arrays)
    offs = fusion.offsets(arrays)
    assert layout.count == offs[-1] and layout.shapes == tuple(shapes) and layout.dtype == np.dtype(dtype)
    want = np.zeros(offs[-1], dtype)  # padding zeroed
    for a, o in zip(arrays, offs):
        want[o:o + a.size] = a.reshape(-1)
    out = np.full(layout.count, 7, dtype)
    layout.pack(arrays, out)
    assert out.tobytes() == want.tobytes()
    parts = layout.views(out)
    assert [p.shape for p in parts] == list(shapes)
    assert all(np.array_equal(p, a) and (p.size == 0 or np.shares_memory(p, out)) for p, a in zip(parts, arrays))


def test_the_compiled_pack_leaves_what_it_cannot_copy_to_python_and_refuses_bad_views():
    with _compiled_step(True):
        arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(5, dtype=np.float32)]
        layout = fusion.Layout(arrays)
        want = np.full(layout.count, 9, np.float32)
        with _compiled_step(False):
            layout.pack(arrays, want)
        for other in ([arrays[0].T.copy().T, arrays[1]],  # (a part not C-contiguous)
                      [arrays[0], arrays[1].astype(np.float64)],  # (another dtype: numpy casts it)
                      (arrays[0], arrays[1])):  # (not a list)
            assert not (type(other) is list and other[0].flags.c_contiguous and other[1].dtype == np.float32)
            out = np.full(layout.count, 9, np.float32)
            layout.pack(other, out)
            assert out.tobytes() == want.tobytes()
        step = native.loaded()
        assert step.pack(arrays, np.empty(layout.count - 1, np.float32), layout.starts) is False  # (too short)
        with pytest.raises(ValueError):
            step.views(want, [(0, layout.count + 1, None)])
        with pytest.raises(ValueError):
            step.views(want, [(0, 4, (5,))])
        with pytest.raises(ValueError):
            step.views(want.reshape(1, -1), [(0, 1, None)])


def test_the_compiled_plan_check_matches_python_s_comparison():
    # (sdp.api._grouped_submit keeps a group's plan while every array has its (dtype, shape))
    with _compiled_step(True):
        step = native.loaded()
        arrays = [np.zeros((2, 3), np.float32), np.zeros(5, np.float32), np.zeros((), np.int64)]
        metas = [(a.dtype, a.shape) for a in arrays]
        others = [[np.zeros((3, 2), np.float32)] + arrays[1:],  # (a shape)
                  [arrays[0], np.zeros(5, np.float64), arrays[2]],  # (a dtype)
                  [arrays[0], np.zeros(5, ">f4"), arrays[2]],  # (a byte order)
                  [arrays[0], np.zeros(4, np.float32), arrays[2]],
                  arrays[:2],  # (fewer)
                  [arrays[0], [0.0] * 5, arrays[2]],  # (not an array: Python converts it)
                  [arrays[0], np.ma.zeros(5, np.float32), arrays[2]],  # (a subclass)
                  [np.zeros((2, 3), np.dtype("<f4")), np.zeros(5, "=f4"), arrays[2][()] * np.zeros((), np.int64)]]
        for other in [arrays] + others:
            python = [(a.dtype, a.shape) for a in other if type(a) is np.ndarray] == metas
            assert step.same_metas(other, metas) is python, other
        with pytest.raises(TypeError):
            step.same_metas(tuple(arrays), metas)


def test_the_compiled_exportable_check_matches_python_s():
    """sdp.tensorflow.ops.as_output's check (TensorFlow wraps a result through DLPack only when it
    is not empty, C-contiguous, writeable and 64-byte aligned), in C and as numpy's attributes say."""
    with _compiled_step(True):
        step = native.loaded()
        base = fusion.aligned_empty(np.float32, 64)
        readonly = fusion.aligned_empty(np.float32, 16)
        readonly.flags.writeable = False
        cases = [base, base[16:32], base[1:17], base[::2], readonly, base[:0], base.reshape(8, 8).T,
                 base.reshape(8, 8), np.float32(1.0), [1.0]]
        for arr in cases:
            want = bool(isinstance(arr, np.ndarray) and arr.size and arr.flags.c_contiguous and arr.flags.writeable
                        and arr.ctypes.data % fusion.ALIGN_BYTES == 0)
            assert step.exportable(arr) is want, (arr, want)
        assert [step.exportable(a) for a in cases[:4]] == [True, True, False, False]
