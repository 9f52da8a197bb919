"""Rank functions for the device-path tests (tests/test_device.py; on a GPU machine, tests/gpu/).

``kind`` names how a rank hands its arrays to sdp: ``fake`` (host memory behind a
``__cuda_array_interface__``, with ``SDP_DEVICE_BACKEND=numpy``), ``gpuarray`` (PyCUDA), ``cupy``,
``torch``, ``capsule`` (a raw DLPack capsule of a CuPy array, as TensorFlow hands them over).
"""
import hashlib

import numpy as np

import sdp
from sdp.common.reduce_ops import ReduceOp
from sdp.engine.backends import reduce_arrays

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
          "int64", "uint64", "bool"]
OPS = ["SUM", "AVERAGE", "MIN", "MAX", "PRODUCT"]


def np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def data_for(rank, shape, dtype, seed):
    rng = np.random.default_rng(seed * 1000 + rank)
    dt = np_dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dt.kind in "iu":
        lo = 0 if dt.kind == "u" else -5
        return rng.integers(lo, 6, shape).astype(dt)
    return (rng.standard_normal(shape) * 3).astype(np.float32).astype(dt)


class FakeDevice:
    """Host memory offered as a CUDA array through ``__cuda_array_interface__`` (for the numpy
    backend; bfloat16, which that interface cannot name, goes as :class:`FakeDLPack`)."""

    def __init__(self, arr):
        self.arr = np.ascontiguousarray(arr)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.arr.shape, "typestr": self.arr.dtype.str, "data": (self.arr.ctypes.data, False),
                "strides": None, "version": 3}


class FakeDLPack:
    """Host memory offered as a CUDA array through ``__dlpack__`` (a capsule that says kDLCUDA)."""

    def __init__(self, arr):
        self.arr = np.ascontiguousarray(arr)

    def __dlpack__(self, stream=None, **_):
        from sdp.engine.device_arrays import KDL_CUDA, make_capsule
        return make_capsule(self.arr.ctypes.data, self.arr.shape, self.arr.dtype, KDL_CUDA, 0, self)

    def __dlpack_device__(self):
        return 2, 0


def make(kind, arr):
    if kind == "fake":
        return FakeDevice(arr) if arr.dtype.name != "bfloat16" else FakeDLPack(arr)
    if kind == "fakedl":
        return FakeDLPack(arr)
    if kind in ("gpuarray", "cupy") and arr.dtype.name == "bfloat16":
        return None  # neither has a bfloat16 dtype
    if kind == "gpuarray":
        import pycuda.autoprimaryctx  # noqa: F401 - the primary context, as sdp's engine uses
        from pycuda import gpuarray
        return gpuarray.to_gpu(arr)
    if kind == "cupy":
        import cupy
        return cupy.asarray(arr)
    if kind == "torch":
        import torch
        if arr.dtype.name == "bfloat16":
            return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16).cuda()
        if arr.dtype.kind == "u" and arr.dtype.itemsize > 1:
            return None  # torch has no usable uint16/32/64 on CUDA
        return torch.from_numpy(arr.copy()).cuda()
    if kind == "capsule":
        import cupy
        return cupy.asarray(arr).toDlpack() if arr.dtype.name != "bfloat16" else None
    raise ValueError(kind)


def to_numpy(kind, res, dtype):
    if isinstance(res, tuple):
        res = res[0]
    if kind == "gpuarray":
        return res.get()
    if kind == "cupy":
        import cupy
        return cupy.asnumpy(res)
    if kind == "torch":
        import torch
        if res.dtype == torch.bfloat16:
            return res.view(torch.int16).cpu().numpy().view(np_dtype("bfloat16"))
        return res.cpu().numpy()
    if kind == "capsule":
        import cupy
        return cupy.asnumpy(cupy.from_dlpack(_Cap(res)))
    if kind in ("fake", "fakedl"):
        from sdp.engine.device_arrays import Exported
        assert isinstance(res, Exported), type(res)
        t = res.tensor
        raw = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * max(1, t.nbytes)).from_address(t.ptr))
        return raw[:t.nbytes].view(t.dtype).reshape(t.shape).copy()
    raise ValueError(kind)


class _Cap:
    def __init__(self, cap):
        self.cap = cap

    def __dlpack__(self, stream=None, **_):
        return self.cap

    def __dlpack_device__(self):
        return 2, 0


def run_case(kind, case, n, r, against="reference"):
    """One case; ``against``: "reference" (:func:`reduce_arrays`, the device path's arithmetic)
    or "host" (the same collective on numpy arrays: what a staged device array must equal)."""
    coll, dtype, op, shape, pre, post, seed = case
    dt = np_dtype(dtype)
    mine = data_for(r, shape, dtype, seed)
    x = make(kind, mine)
    if x is None:
        return None
    name = f"{coll}.{seed}"
    red = getattr(ReduceOp, op) if op else None
    if coll == "allreduce":
        res = sdp.allreduce(x, name=name, op=red, prescale_factor=pre, postscale_factor=post)
        ref = _ref(dt, n, shape, dtype, seed, red, pre, post)
    elif coll == "reducescatter":
        res = sdp.reducescatter(x, name=name, op=red, prescale_factor=pre, postscale_factor=post)
        full = _ref(dt, n, shape, dtype, seed, red, pre, post)
        rows = [shape[0] // n + (q < shape[0] % n) for q in range(n)]
        edges = np.concatenate([[0], np.cumsum(rows)])
        ref = full[edges[r]:edges[r + 1]]
    elif coll == "broadcast":
        res = sdp.broadcast(x, root_rank=seed % n, name=name)
        ref = data_for(seed % n, shape, dtype, seed)
    elif coll == "allgather":
        rows = [1 + (q + seed) % 3 for q in range(n)]
        mine = data_for(r, [rows[r]] + shape[1:], dtype, seed)
        res = sdp.allgather(make(kind, mine), name=name)
        ref = np.concatenate([data_for(q, [rows[q]] + shape[1:], dtype, seed) for q in range(n)])
    elif coll == "alltoall":
        splits = [(q + r + seed) % 3 for q in range(n)]
        mine = data_for(r, [sum(splits)] + shape[1:], dtype, seed)
        res, rsplits = sdp.alltoall(make(kind, mine), splits=splits, name=name)
        blocks = []
        for q in range(n):
            theirs = [(j + q + seed) % 3 for j in range(n)]
            d = data_for(q, [sum(theirs)] + shape[1:], dtype, seed)
            blocks.append(d[sum(theirs[:r]):sum(theirs[:r + 1])])
        ref = np.concatenate(blocks)
        assert list(rsplits) == [(r + q + seed) % 3 for q in range(n)]
    else:
        raise ValueError(coll)
    if against == "host" and coll in ("allreduce", "reducescatter"):
        fn = sdp.allreduce if coll == "allreduce" else sdp.reducescatter
        ref = fn(data_for(r, shape, dtype, seed), name=name + ".host", op=red, prescale_factor=pre,
                 postscale_factor=post)
    got = to_numpy(kind, res, dt)
    ok = got.dtype == ref.dtype and got.shape == ref.shape and np.array_equal(
        got.view(np.uint8), ref.view(np.uint8)) if got.size else got.shape == ref.shape
    return [bool(ok), hashlib.sha1(got.tobytes()).hexdigest()[:12]]


def _ref(dt, n, shape, dtype, seed, op, pre, post):
    srcs = [data_for(q, shape, dtype, seed) for q in range(n)]
    if dt.kind in "iub":
        return reduce_arrays(srcs, op, pre, None, n if op == ReduceOp.AVERAGE else 1, post)
    scale = post / (n if op == ReduceOp.AVERAGE else 1)
    return reduce_arrays(srcs, op, pre, None if scale == 1.0 else scale)


def matrix(seed0=1):
    """Every collective x dtype x op, with pre/post-scale factors not representable in float16."""
    cases, s = [], seed0
    for dtype in DTYPES:
        floats = np_dtype(dtype).kind == "f"
        for op in OPS:
            if dtype == "bool" and op == "AVERAGE":
                continue
            scales = [(1.0, 1.0)]
            if dtype != "bool" and op in ("SUM", "AVERAGE"):
                scales.append((0.3, 1.7) if floats else (2.0, 3.0))
            for pre, post in scales:
                s += 1
                cases.append(["allreduce", dtype, op, [37, 3], pre, post, s])
                s += 1
                cases.append(["reducescatter", dtype, op, [7, 5], pre, post, s])
        for coll in ("broadcast", "allgather", "alltoall"):
            s += 1
            cases.append([coll, dtype, None, [4, 3], 1.0, 1.0, s])
    return cases


def device_matrix(kind, cases, against="reference"):
    """Run ``cases`` with ``kind`` arrays; returns ``(results, counters)``; results: per case
    ``[bit-exact against the reference, result hash]`` or None where ``kind`` cannot hold the dtype."""
    n, r = sdp.size(), sdp.rank()
    out = [run_case(kind, c, n, r, against) for c in cases]
    return out, {k: v for k, v in sdp.device_counters().items()}


def fused_bucket(kind, count, elems):
    """``count`` float32 tensors allreduced in one grouped call (one fusion bucket); bit-exact check."""
    n, r = sdp.size(), sdp.rank()
    arrays = [data_for(r, [elems], "float32", 100 + i) for i in range(count)]
    res = sdp.grouped_allreduce([make(kind, a) for a in arrays], op=sdp.Sum, name="fused")
    ok = True
    for i, x in enumerate(res):
        ref = reduce_arrays([data_for(q, [elems], "float32", 100 + i) for q in range(n)], ReduceOp.SUM)
        ok &= bool(np.array_equal(to_numpy(kind, x, np.float32), ref))
    return ok, sdp.device_counters()


def device_groups(kind, set_ranks=None):
    """Flattened device groups (``grouped_allreduce`` of device tensors): float32 parts of mixed
    shapes, float16 parts and, with ``kind`` "fake", parts offered through
    DLPack instead (another kind: a group of their own), AVERAGE with a postscale; then the same
    list through ``grouped_allreduce_async`` (a handle per part).  Each part bit for bit against
    the reference arithmetic and returned as its own kind; ``set_ranks``: in a process set of
    those ranks (staged through host memory).  Returns ``(oks, negotiated names, counters)``."""
    n, r = sdp.size(), sdp.rank()
    ps = sdp.api.add_process_sets([set_ranks])[0] if set_ranks else 0
    if set_ranks and r not in set_ranks:
        return [], [], sdp.device_counters()
    members = len(set_ranks) if set_ranks else n
    ranks = set_ranks or list(range(n))
    specs = [([7, 3], "float32", 0), ([1], "float32", 0), ([1000], "float32", 0), ([5], "float16", 0),
             ([33, 2], "float16", 0), ([16], "float32", 1), ([4, 4], "float32", 1), ([129], "float32", 0)]
    oks = []
    for rnd, call in enumerate(("grouped", "async")):
        seed = 300 + 20 * rnd
        xs = [FakeDLPack(data_for(r, shape, dt, seed + i)) if other and kind == "fake" else make(kind, data_for(r, shape, dt, seed + i))
              for i, (shape, dt, other) in enumerate(specs)]
        names = [f"grp{rnd}.{i}" for i in range(len(specs))]
        if call == "grouped":
            got = sdp.api.grouped_allreduce_named(xs, names, op=sdp.Average, postscale_factor=1.7, process_set=ps)
        else:
            hs = sdp.api.grouped_allreduce_async(xs, names, op=sdp.Average, postscale_factor=1.7, process_set=ps)
            got = [h.wait() for h in hs]
        for i, ((shape, dt, other), res) in enumerate(zip(specs, got)):
            want = reduce_arrays([data_for(q, shape, dt, seed + i).reshape(-1) for q in ranks], ReduceOp.AVERAGE,
                                 1.0, 1.7 / members).reshape(shape)
            kind_ok = type(res).__name__ == ("Exported" if kind == "fake" else type(xs[i]).__name__)
            vals = to_numpy(kind, res, np_dtype(dt))
            oks.append(kind_ok and vals.shape == tuple(shape) and vals.dtype == want.dtype
                       and np.array_equal(vals.view(np.uint8), want.view(np.uint8)))
    negotiated = sorted(k for k in sdp.api.runtime()._cache if k.startswith("grp"))
    return oks, negotiated, sdp.device_counters()


def device_group_mismatch(kind):
    """Rank 1's fourth part is longer, then rank 1 sends host arrays where rank 0 sends device
    arrays: each a TensorMismatchError on every rank."""
    r, out = sdp.rank(), []
    for name, make_x in (("gshape", lambda i: make(kind, np.ones(5 + (r if i == 3 else 0), np.float32))),
                         ("ghostdev", lambda i: make(kind, np.ones(5, np.float32)) if r == 0 else np.ones(5, np.float32))):
        try:
            sdp.grouped_allreduce([make_x(i) for i in range(6)], name=name)
            out.append("no error")
        except sdp.TensorMismatchError as e:
            out.append(str(e))
    return out


def fp16_compressed(kind):
    """Horovod's ``Compression.fp16`` on device arrays: float32 cast to float16 on the device,
    averaged in float16 (scaled in float32), cast back; bit-exact against the same arithmetic in
    numpy.  Returns ``(ok, result dtype name, counters)``."""
    import cupy
    n, r = sdp.size(), sdp.rank()
    x = cupy.asarray(data_for(r, [4099], "float32", 77))
    got = sdp.allreduce(x.astype(cupy.float16), op=sdp.Average, name="fp16")
    back = got.astype(cupy.float32)
    ref = reduce_arrays([data_for(q, [4099], "float32", 77).astype(np.float16) for q in range(n)],
                        ReduceOp.AVERAGE, 1.0, 1.0 / n).astype(np.float32)
    return bool(np.array_equal(cupy.asnumpy(back), ref)), str(got.dtype), sdp.device_counters()


def staged_slabs(kind, count):
    """Lone allreduces staged through host memory (``SDP_GPU_IPC=0``): float32 SUM, float16
    AVERAGE (scaled in float32 inside the collective) and int32 MAX of ``count`` elements, bit for
    bit against the same allreduce of numpy arrays; returns the per-case results and the counters."""
    r = sdp.rank()
    oks = []
    for i, (dtype, op) in enumerate([("float32", "SUM"), ("float16", "AVERAGE"), ("int32", "MAX")]):
        red = getattr(ReduceOp, op)
        got = sdp.allreduce(make(kind, data_for(r, [count], dtype, 50 + i)), op=red, name=f"slabs{i}")
        ref = sdp.allreduce(data_for(r, [count], dtype, 50 + i), op=red, name=f"slabs{i}.host")
        oks.append(bool(np.array_equal(to_numpy(kind, got, np_dtype(dtype)).view(np.uint8), ref.view(np.uint8))))
    return oks, sdp.device_counters()


def mismatch(kind):
    """Rank 1 sends a host array where rank 0 sends a device array, then a shape mismatch."""
    out = []
    x = np.ones(8, np.float32)
    try:
        sdp.allreduce(make(kind, x) if sdp.rank() == 0 else x, name="hostdev")
        out.append("no error")
    except sdp.TensorMismatchError as e:
        out.append(str(e))
    try:
        sdp.allreduce(make(kind, np.ones(4 + sdp.rank(), np.float32)), name="shape")
        out.append("no error")
    except sdp.TensorMismatchError as e:
        out.append(str(e))
    return out


def kernel_matrix(count=1003):
    """Every dtype x op x source count (1..4) x pre/post-scale through the CUDA backend's reduce
    kernel, against :func:`reduce_arrays` bit for bit; destinations poisoned first.  With 3
    sources every pointer is one element past a 16-byte boundary (the element-wise loop; else the
    16-byte packs and the tail).  Returns the failing cases (empty: all exact) and how many ran."""
    import pycuda.driver as cuda

    from sdp.engine.cuda_backend import CudaBackend
    b = CudaBackend(0)
    bad, ran = [], 0
    with b:
        for dtype in DTYPES:
            dt = np_dtype(dtype)
            for op in OPS:
                if dtype == "bool" and op == "AVERAGE":
                    continue
                for nsrc in (1, 2, 3, 4):
                    scales = [(1.0, 1.0)] + ([(0.3, 1.7), (2.0, 3.0)] if dtype != "bool" else [])
                    for pre, post in scales:
                        srcs = [data_for(q, [count], dtype, ran) for q in range(nsrc)]
                        if dt.kind in "iub":
                            divide = nsrc if op == "AVERAGE" else 1
                            scale = None
                        else:
                            divide, s = 1, post / (nsrc if op == "AVERAGE" else 1)
                            scale = None if s == 1.0 else s
                        red = getattr(ReduceOp, op)
                        shift = 1 if nsrc == 3 else 0
                        ref = reduce_arrays([x[shift:] for x in srcs], red, pre, scale, divide, post)
                        dev = [cuda.to_device(np.ascontiguousarray(s).view(np.uint8)) for s in srcs]
                        outs = [cuda.to_device(np.full(count * dt.itemsize, 0xAB, np.uint8)) for _ in range(2)]
                        at = shift * dt.itemsize
                        b.reduce([int(d) + at for d in dev], [int(o) + at for o in outs], count - shift, dt, red, pre,
                                 scale, divide, post)
                        b.synchronize()
                        for o in outs:
                            got = cuda.from_device(o, (count * dt.itemsize,), np.uint8).view(dt)[shift:]
                            if not np.array_equal(got.view(np.uint8), ref.view(np.uint8)):
                                diff = int(np.sum(got.view(np.uint8) != ref.view(np.uint8)))
                                bad.append([dtype, op, nsrc, pre, post, diff])
                                break
                        ran += 1
    return bad, ran


def lane_device(kind, big):
    """Synchronous device allreduces the fast lane runs in the calling thread: the first opens
    the windows (the engine's), then ops and dtypes in step, the last rank late by 1 ms (past
    the caller's poll: held, decided later) and by 20 ms (past the escalation: the engine's),
    one beside an asynchronous one (the engine's), a group, one of ``big`` float32 elements
    (over the windows: the engine grows them) and one after it (the lane, in the new windows).
    Returns ``(per call: bit-exact, the device counters, the lane's counts)``."""
    import time
    n, r = sdp.size(), sdp.rank()
    oks, seed = [], 500

    def one(name, shape, dtype="float32", op="SUM", post=1.0, late=0.0):
        nonlocal seed
        seed += 1
        if late and r == n - 1:
            time.sleep(late)
        got = sdp.allreduce(make(kind, data_for(r, shape, dtype, seed)), name=name, op=getattr(ReduceOp, op),
                            postscale_factor=post)
        ref = _ref(np_dtype(dtype), n, shape, dtype, seed, getattr(ReduceOp, op), 1.0, post)
        oks.append(bool(np.array_equal(to_numpy(kind, got, np_dtype(dtype)).view(np.uint8), ref.view(np.uint8))))

    one("warm", [1000])
    for i, (dtype, op, post) in enumerate([("float32", "SUM", 1.0), ("float16", "AVERAGE", 1.7),
                                           ("int32", "AVERAGE", 3.0), ("float64", "MIN", 1.0),
                                           ("int64", "PRODUCT", 1.0), ("uint8", "MAX", 1.0)]):
        one(f"step{i}", [37, 3], dtype, op, post)
    one("late1ms", [1000], late=0.001)
    one("late20ms", [1000], late=0.02)
    h = sdp.allreduce_async(make(kind, np.full(10, r, np.float32)), name="async", op=sdp.Sum)
    one("beside", [100])
    oks.append(bool(np.array_equal(to_numpy(kind, h.wait(), np.float32), np.full(10, n * (n - 1) / 2, np.float32))))
    parts = [data_for(r, [5 + i], "float32", 900 + i) for i in range(10)]
    got = sdp.grouped_allreduce([make(kind, a) for a in parts], name="group", op=sdp.Sum)
    for i, x in enumerate(got):
        ref = reduce_arrays([data_for(q, [5 + i], "float32", 900 + i) for q in range(n)], ReduceOp.SUM)
        oks.append(bool(np.array_equal(to_numpy(kind, x, np.float32), ref)))
    one("big", [big])
    one("after big", [big])
    lane = sdp.api.runtime().lane
    return oks, sdp.device_counters(), dict(lane.counts) if lane is not None else {}


def device_error(kind):
    """After a warm-up (the engine opens the windows, then the lane runs one), rank 1's device
    reductions fail (the numpy backend's, patched: a CUDA error stands in); returns each rank's
    error type, seconds to it and message."""
    import time
    from sdp.engine.backends import NumpyBackend
    x = make(kind, np.ones(1000, np.float32))
    sdp.allreduce(x, name="warm")
    sdp.allreduce(x, name="second")
    if sdp.rank() == 1:
        def failing(*args, **kw):
            raise RuntimeError("simulated device error")
        NumpyBackend.reduce = failing
    t0 = time.monotonic()
    try:
        for i in range(5):
            sdp.allreduce(x, name=f"after{i}")
        return ["no error", time.monotonic() - t0, ""]
    except Exception as e:  # noqa: BLE001
        return [type(e).__name__, time.monotonic() - t0, str(e)]


def killed_peer(kind):
    """Rank 1 dies before a device allreduce; returns rank 0's error type and seconds to it."""
    import os
    import time
    x = make(kind, np.ones(1 << 20, np.float32))
    sdp.allreduce(x, name="warm")
    if sdp.rank() == 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        sdp.allreduce(x, name="after")
        return ["no error", time.monotonic() - t0]
    except Exception as e:  # noqa: BLE001
        return [type(e).__name__, time.monotonic() - t0]


def join_with_device_arrays(kind):
    """Rank 1 joins at once; rank 0 allreduces device arrays (zeros come from rank 1), then joins."""
    if sdp.rank() == 1:
        return [sdp.join()]
    out = []
    for i in range(3):
        x = data_for(0, [50], "float32", i)
        res = to_numpy(kind, sdp.allreduce(make(kind, x), name=f"j{i}", op=sdp.Sum), np.float32)
        out.append(bool(np.array_equal(res, x)))
    return out + [sdp.join()]


def host_16bit_scaling(set_ranks=None):
    """float16/bfloat16 allreduce and reducescatter of host arrays with factors float16 cannot hold
    (0.1, 1/3): the host paths scale in float32 and round once, as Horovod does (issue 31 item 3).
    Returns per case whether the result equals :func:`reduce_arrays` bit for bit."""
    ps = sdp.api.add_process_sets([set_ranks])[0] if set_ranks else 0
    ranks = set_ranks or list(range(sdp.size()))
    out = []
    for dtype in ("float16", "bfloat16") if sdp.rank() in ranks else ():
        srcs = [data_for(q, [1000], dtype, 7) for q in ranks]
        mine = srcs[ranks.index(sdp.rank())]
        got = sdp.allreduce(mine, op=ReduceOp.SUM, prescale_factor=0.1, postscale_factor=1 / 3,
                            name=f"s16.{dtype}", process_set=ps)
        ref = reduce_arrays(srcs, ReduceOp.SUM, 0.1, 1 / 3)
        out.append(bool(np.array_equal(got.view(np.uint8), ref.view(np.uint8))))
        got = sdp.reducescatter(mine.reshape(100, 10), op=ReduceOp.AVERAGE, prescale_factor=0.1,
                                name=f"rs16.{dtype}", process_set=ps)
        full = reduce_arrays([s.reshape(100, 10) for s in srcs], ReduceOp.AVERAGE, 0.1, 1 / len(ranks))
        rows = [100 // len(ranks) + (q < 100 % len(ranks)) for q in range(len(ranks))]
        lo = sum(rows[:ranks.index(sdp.rank())])
        want = full[lo:lo + rows[ranks.index(sdp.rank())]]
        out.append(bool(np.array_equal(got.view(np.uint8), want.view(np.uint8))))
    sdp.barrier()  # a rank outside the set must not shut down while the set's collectives run
    return out
