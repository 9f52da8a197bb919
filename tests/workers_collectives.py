"""Worker functions run inside real rank processes by tests/harness.py."""
import itertools

import numpy as np

import sdp

DTYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64, "int32": np.int32,
          "int64": np.int64, "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "bool": np.bool_}


def data_for(rank, shape, dtype, seed):
    """The same pseudo-random array on any process that asks for (rank, seed)."""
    rng = np.random.default_rng(seed * 1000 + rank)
    dt = np.dtype(DTYPES[dtype])
    if dt.kind == "f":
        return rng.standard_normal(shape).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    hi = 3 if dt.itemsize == 1 else 50
    lo = 0 if dt.kind == "u" else -hi
    return rng.integers(lo, hi, shape).astype(dt)


def reference(op, arrays):
    stack = np.stack([a.astype(np.float64) if a.dtype.kind == "f" else a for a in arrays])
    if op == "SUM":
        return stack.sum(0)
    if op == "AVERAGE":
        return stack.mean(0) if stack.dtype.kind == "f" else stack.sum(0) // len(arrays)
    if op == "MIN":
        return stack.min(0)
    if op == "MAX":
        return stack.max(0)
    if op == "PRODUCT":
        return stack.prod(0)
    raise ValueError(op)


def allreduce_cases(cases):
    """Each case: [shape, dtype, op, seed].  Returns list of max abs errors (or mismatch flags)."""
    n, r = sdp.size(), sdp.rank()
    errs = []
    for shape, dtype, op, seed in cases:
        mine = data_for(r, shape, dtype, seed)
        out = sdp.allreduce(mine, op=getattr(sdp.ReduceOp, op), name=f"t{seed}")
        ref = reference(op, [data_for(q, shape, dtype, seed) for q in range(n)])
        assert out.shape == tuple(shape) and out.dtype == mine.dtype, (out.shape, out.dtype)
        if np.dtype(DTYPES[dtype]).kind == "f":
            tol = 1e-2 if dtype == "float16" else 1e-5
            errs.append(float(np.max(np.abs(out - ref), initial=0) / max(1.0, np.max(np.abs(ref), initial=0))) <= tol)
        else:
            errs.append(bool(np.array_equal(out, ref.astype(out.dtype))))
    return errs


def broadcast_cases(cases):
    """Each case: [shape, dtype, root, seed]; returns list of bools (equal to root's data)."""
    ok = []
    for shape, dtype, root, seed in cases:
        out = sdp.broadcast(data_for(sdp.rank(), shape, dtype, seed), root, name=f"b{seed}")
        ok.append(bool(np.array_equal(out, data_for(root, shape, dtype, seed))))
    return ok


def checksum_of_allreduce(n_elems):
    out = sdp.allreduce(np.arange(n_elems, dtype=np.float32) * (sdp.rank() + 1), op=sdp.Sum)
    return out.tobytes().hex()[:64] + str(float(out.sum()))


def timeline_run(path):
    import json
    sdp.start_timeline(path)
    # 80 KB each: above GROUP_MEAN_BYTES, so the engine fuses them (FUSE, UNPACK)
    hs = sdp.grouped_allreduce_async([np.ones(20_000, np.float32) * i for i in range(5)], [f"g{i}" for i in range(5)])
    [h.wait() for h in hs]
    sdp.broadcast(np.ones(3), 0, name="bc")
    sdp.stop_timeline()
    if sdp.rank() != 0:
        return None
    with open(path) as f:
        events = json.load(f)
    depth = {}  # (row, phase) -> begins minus ends: 0 for every pair when each B has its E
    for e in events:
        if e["ph"] in "BE":
            key = (e["tid"], e["name"])
            depth[key] = depth.get(key, 0) + (1 if e["ph"] == "B" else -1)
    return [sorted({(e["name"], e["ph"]) for e in events if e["ph"] in "BE"}),
            sorted({f"{k[1]}@{k[0]}:{v}" for k, v in depth.items() if v})]


INT_NAMES = ("int8", "int16", "int32", "int64", "uint8")


def _np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(DTYPES[name])


def _arr(rank, shape, dtype, seed):
    dt = _np_dtype(dtype)
    if dtype == "bfloat16":
        return np.random.default_rng(seed * 1000 + rank).integers(-8, 8, shape).astype(dt)
    return data_for(rank, shape, dtype, seed)


def _close(out, ref, dtype):
    """Floats within the dtype's precision of the float64 reference; integers exactly."""
    if dtype in ("float16", "bfloat16", "float32", "float64"):
        rtol = {"float16": 1e-2, "bfloat16": 1e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
        return np.allclose(out.astype(np.float64), ref, rtol=rtol, atol=rtol)
    return np.array_equal(out, ref.astype(out.dtype))


def every_collective(cases):
    """cases: [kind, dtype, op, shape, seed]; returns list of bools (matches numpy reference)."""
    n, r = sdp.size(), sdp.rank()
    oks = []
    for kind, dtype, op, shape, seed in cases:
        mine = _arr(r, shape, dtype, seed)
        mine.setflags(write=False)  # the engine never writes an input (sdp.tensorflow passes read-only views)
        allx = [_arr(q, shape, dtype, seed) for q in range(n)]
        wide = [a.astype(np.float64) if dtype == "bfloat16" else a for a in allx]  # numpy references
        name = f"{kind}.{seed}"
        if kind == "allreduce":
            out = sdp.allreduce(mine, name=name, op=getattr(sdp.ReduceOp, op))
            ok = _close(out, reference(op, wide), dtype)
        elif kind == "allgather":
            mine = _arr(r, [r + 1] + shape[1:], dtype, seed)  # first dimension differs per rank
            out = sdp.allgather(mine, name=name)
            ok = np.array_equal(out, np.concatenate([_arr(q, [q + 1] + shape[1:], dtype, seed) for q in range(n)]))
        elif kind == "broadcast":
            root = seed % n
            ok = np.array_equal(sdp.broadcast(mine, root, name=name), allx[root])
        elif kind == "alltoall":
            rows = shape[0]
            splits = [(rows * (j + r + 1)) // (n * (n + 1)) for j in range(n)]
            splits[-1] = rows - sum(splits[:-1])
            got, recv_splits = sdp.alltoall(mine, splits=splits, name=name)
            expect = []
            for q in range(n):
                sq = [(rows * (j + q + 1)) // (n * (n + 1)) for j in range(n)]
                sq[-1] = rows - sum(sq[:-1])
                off = sum(sq[:r])
                expect.append(allx[q][off:off + sq[r]])
            ok = np.array_equal(got, np.concatenate(expect)) and list(recv_splits) == [len(e) for e in expect]
        elif kind == "reducescatter":
            out = sdp.reducescatter(mine, name=name, op=getattr(sdp.ReduceOp, op))
            full = reference(op, wide)
            base, extra = divmod(shape[0], n)
            lo = r * base + min(r, extra)
            hi = lo + base + (r < extra)
            ref = full[lo:hi]
            ok = _close(out, ref, dtype)
        elif kind == "grouped_allgather":  # three arrays, first dimensions differing per rank
            rows = [shape[0] + r + k for k in range(3)]
            outs = sdp.grouped_allgather([_arr(r, [rows[k]] + shape[1:], dtype, seed + k) for k in range(3)],
                                         name=name)
            ok = all(np.array_equal(outs[k], np.concatenate(
                [_arr(q, [shape[0] + q + k] + shape[1:], dtype, seed + k) for q in range(n)])) for k in range(3))
        elif kind == "allreduce_scaled":  # integer factors keep integer results exact
            pre, post = (2, 3) if dtype in INT_NAMES else (0.5, 3.0)
            out = sdp.allreduce(mine, name=name, op=sdp.ReduceOp.SUM, prescale_factor=pre, postscale_factor=post)
            wide = np.int64 if dtype in INT_NAMES else np.float64
            ok = _close(out, sum(a.astype(wide) * pre for a in allx) * post, dtype)
        else:
            raise ValueError(kind)
        oks.append(bool(ok))
    return oks


def objects_and_barrier():
    r = sdp.rank()
    sdp.barrier()
    got = sdp.broadcast_object({"from": r, "list": [r] * 3}, root_rank=1)
    every = sdp.allgather_object(("rank", r))
    grouped = sdp.grouped_allreduce([np.full(3, r, np.float32), np.full(2, r, np.int64)], op=sdp.Sum)
    return [got, every, [g.tolist() for g in grouped]]


def repeated_uneven_allgather(steps):
    """Same name every step, rank-dependent first dimension that changes per step."""
    r, n = sdp.rank(), sdp.size()
    ok = True
    for step in range(steps):
        rows = (r + step) % 3 + 1
        out = sdp.allgather(np.full((rows, 2), r, np.int32), name="ag")
        expect = np.concatenate([np.full(((q + step) % 3 + 1, 2), q, np.int32) for q in range(n)])
        ok = ok and np.array_equal(out, expect)
        got, _ = sdp.alltoall(np.arange(n * (step + 1)), name="a2a")
        ok = ok and got.size == n * (step + 1)
    return bool(ok)


def out_and_in_place():
    r = sdp.rank()
    a = np.full(100_000, r + 1.0, np.float32)
    out = np.empty_like(a)
    res = sdp.allreduce(a, name="o", op=sdp.Sum, out=out)
    same = res is out and float(out[0]) == 3.0 and float(a[0]) == r + 1.0
    sdp.allreduce(a, name="inplace", op=sdp.Sum, out=a)
    try:
        sdp.allreduce(a, name="bad", out=np.empty(3, np.float32))
        bad = "no error"
    except ValueError as e:
        bad = str(e)
    return [bool(same), float(a[0]), bad]


def back_to_back_shm(steps):
    """Consecutive shared-memory allreduces with one rank lagging at random points: each result
    must be exact (catches a rank overwriting a half that a peer is still reading)."""
    import random
    import time
    rng = random.Random(sdp.rank())
    n, ok = sdp.size(), True
    for step in range(steps):
        if rng.random() < 0.3:
            time.sleep(0.002)
        a = np.full(50_000 + step, float(step * 10 + sdp.rank()), np.float64)
        out = sdp.allreduce(a, name="b2b", op=sdp.Sum)
        ok = ok and bool(np.all(out == sum(step * 10 + q for q in range(n))))
    return ok


def fp16_average_no_overflow():
    """float16 values near the top of the range: their sum overflows float16, their average
    does not; the engine accumulates and scales in float32, so AVERAGE stays finite."""
    big = np.full(100_000, 40000.0 + sdp.rank(), np.float16)
    avg = sdp.allreduce(big, name="big", op=sdp.Average)
    few = sdp.allreduce(big[:1000], name="few", op=sdp.Average)  # recursive doubling off shared memory
    avg = np.concatenate([avg, few])
    small = sdp.allreduce(np.full(1000, 3e-5, np.float16), name="small", op=sdp.Sum)
    return [float(avg.min()), float(avg.max()), bool(np.isfinite(avg).all()), float(small[0])]


def fused_buckets(seed):
    """Gradient-list style fused allreduces (83 KB to 666 KB; and 60 small ones of 0 to 300
    elements) with tensor boundaries falling inside each rank's own chunk; float32 SUM, float16 AVERAGE, float64 prescaled; each list
    once fused by the engine (one request per tensor) and once as grouped_allreduce_async
    makes it (a flattened group where the mean size allows)."""
    from sdp.engine.runtime import Request
    n, r = sdp.size(), sdp.rank()
    rt = sdp.api.runtime()
    oks = []
    for (dtype, op, pre), grouped, sizes in itertools.product(
            (("float32", "SUM", 1.0), ("float16", "AVERAGE", 1.0), ("float64", "SUM", 0.5)), (False, True),
            ([1, 30_001, 7, 12_345, 0, 40_000, 3], [i * 37 % 301 for i in range(60)])):  # (many small:
        # each rank packs its own chunk before reducing it)
        mine = [data_for(r, [s], dtype, seed + i) for i, s in enumerate(sizes)]
        for a in mine:
            a.setflags(write=False)
        names = [f"{dtype}.{grouped}.{len(sizes)}.{i}" for i in range(len(sizes))]
        if grouped:
            hs = sdp.grouped_allreduce_async(mine, names, op=getattr(sdp.ReduceOp, op), prescale_factor=pre)
        else:
            hs = rt.submit_many([Request(nm, "allreduce", a, op=getattr(sdp.ReduceOp, op), prescale=pre)
                                 for nm, a in zip(names, mine)])
        for i, h in enumerate(hs):
            ref = reference(op, [data_for(q, [sizes[i]], dtype, seed + i) for q in range(n)]) * pre
            out = h.wait()
            # every tensor of a bucket starts on 64 bytes (TensorFlow takes such results without a copy)
            oks.append(_close(out, ref, dtype) and (out.size == 0 or out.ctypes.data % 64 == 0))
    return oks


def held_results(steps):
    """Rank 0 keeps every allreduce result (single and grouped) while the other ranks drop
    theirs at once, so rank 0's shared-memory result pool runs out first and the ranks disagree
    on whether peers can write results straight into it.  Values change every step, so a block
    written again while rank 0 still holds it would show.  Returns (all exact, pool bytes free
    at the end or None)."""
    n, r = sdp.size(), sdp.rank()
    held, ok = [], True
    for step in range(steps):
        single = sdp.allreduce(np.full(70_000, float(step * 10 + r), np.float32), name="single", op=sdp.Sum)
        grads = [np.full(30_000 + i, float(step + i + r), np.float64) for i in range(3)]
        fused = [h.wait() for h in sdp.grouped_allreduce_async(grads, [f"g{i}" for i in range(3)], op=sdp.Sum)]
        expect = [sum(step * 10 + q for q in range(n))] + [sum(step + i + q for q in range(n)) for i in range(3)]
        got = [single] + fused
        if r == 0:
            held.append((expect, got))
        else:
            ok = ok and all(bool(np.all(g == e)) for e, g in zip(expect, got))
    for expect, got in held:
        ok = ok and all(bool(np.all(g == e)) for e, g in zip(expect, got))
    pool = sdp.api.runtime().mesh.shm.pool if sdp.api.runtime().mesh.shm is not None else None
    return [ok, None if pool is None else pool.free_bytes()]


def steady_state_lists(steps):
    """A gradient list submitted step after step with new values: in the same order on every
    rank as one submission (the coordinator's batch cache: announced once, then sent by number)
    and, every third step, tensor by tensor in a per-rank random order (the normal path).
    (Tensor-by-tensor in-order lists may reach the engine split in two when it wakes mid-list,
    which takes the normal path, so the batch-cache steps use one submission.)
    Returns (all exact, batches known, the most tensors in one known batch)."""
    import random
    n, r = sdp.size(), sdp.rank()
    rng = random.Random(r)
    sizes = [100_000, 5, 70_000, 300, 20_000]
    ok = True
    for step in range(steps):
        order = list(range(len(sizes)))
        arrays = {i: np.full(sizes[i], float(step * 100 + i * 10 + r), np.float32) for i in order}
        if step % 3 == 2:
            rng.shuffle(order)
            hs = {i: sdp.allreduce_async(arrays[i], name=f"t{i}", op=sdp.Sum) for i in order}
        else:
            hs = dict(zip(order, sdp.api.grouped_allreduce_async([arrays[i] for i in order],
                                                                 names=[f"t{i}" for i in order], op=sdp.Sum)))
        for i, h in hs.items():
            ok = ok and bool(np.all(h.wait() == sum(step * 100 + i * 10 + q for q in range(n))))
    batches = sdp.api.runtime()._batches
    return [ok, len(batches), max((len(items) for items in batches.values()), default=0)]


def topology_values():
    """(local rank, local size, cross rank, cross size) as sdp reports them, and a SUM check."""
    total = float(sdp.allreduce(np.ones(4), name="topo", op=sdp.Sum)[0])
    return [sdp.local_rank(), sdp.local_size(), sdp.cross_rank(), sdp.cross_size(), total]


def timeline_from_env():
    """With SDP_TIMELINE set before init(): a fused list, then shutdown() finishes the file."""
    import json
    import os
    hs = sdp.grouped_allreduce_async([np.ones(10, np.float32) * i for i in range(4)], [f"e{i}" for i in range(4)])
    [h.wait() for h in hs]
    sdp.shutdown()
    if os.environ["SDP_RANK"] != "0":
        return []
    with open(os.environ["SDP_TIMELINE"]) as f:
        events = json.load(f)
    return sorted({e["args"]["name"] for e in events if e["ph"] == "M"} |
                  {e["name"] for e in events if e["ph"] == "B"})


def control_path(steps):
    """Collectives of every kind with the control messages in shared memory (every rank on one
    host), including one request too large for a ring (2,000 new tensor names: it goes over
    ZeroMQ, in order with the ring).  Returns (rings in use, ring bytes this rank sent to rank 0
    or, on rank 0, to rank 1, all results exact)."""
    n, r = sdp.size(), sdp.rank()
    rt = sdp.api.runtime()
    ctrl = rt.mesh.ctrl
    rings = ctrl is not None and bool(ctrl.bells) and all(ctrl.senders.values())
    ok = True
    for k in range(steps):
        ok &= bool(np.all(sdp.allreduce(np.full(7, r + k, np.float32), name="ar", op=sdp.Sum)
                          == n * k + n * (n - 1) / 2))
        ok &= bool(np.all(sdp.broadcast(np.full(3, r, np.int64), root_rank=n - 1, name="bc") == n - 1))
        got = sdp.allgather(np.full((r + 1, 2), r, np.int32), name="ag")
        ok &= got.shape == (n * (n + 1) // 2, 2)
        out, rows = sdp.alltoall(np.full(n, r, np.float64), splits=[1] * n, name="a2a")
        ok &= bool(np.all(out == np.arange(n)))
        ok &= bool(np.all(sdp.reducescatter(np.ones((n, 2), np.float32), name="rs", op=sdp.Sum) == n))
        sdp.barrier()
    # one request per tensor (grouped_allreduce would flatten them into one small request)
    from sdp.engine.runtime import Request
    hs = rt.submit_many([Request(f"many.{i}", "allreduce", np.full(3, i, np.float32)) for i in range(2000)])
    ok &= all(bool(np.all(h.wait() == n * i)) for i, h in enumerate(hs))
    ok &= sdp.broadcast_object({"rank": r}, root_rank=0) == {"rank": 0}
    sent = ctrl._wpos.get(1 if r == 0 else 0, 0) if ctrl is not None else 0
    return [rings, int(sent), bool(ok)]


def flattened_groups():
    """grouped_allreduce_async of small host arrays: one request per dtype (a flattened group),
    results exact, aligned views of the input shapes; a shape mismatch inside a group with the
    same total size is a TensorMismatchError on every rank; a joined rank's zeros fill a group.
    Returns a list of (check, passed) pairs."""
    from sdp.common.errors import TensorMismatchError
    n, r = sdp.size(), sdp.rank()
    rt = sdp.api.runtime()
    checks = []
    shapes = [(i % 5 + 1, 3) for i in range(40)] + [(), (0,), (7,)]

    def data(q):  # rank q's arrays: float32 of many shapes, int64, a float16 scalar
        return ([np.full(s, q + i, np.float32) for i, s in enumerate(shapes)]
                + [np.full(3, q - i, np.int64) for i in range(3)] + [np.array(0.5 + q, np.float16)])

    mine = data(r)
    want = [sum(arrays) for arrays in zip(*[data(q) for q in range(n)])]
    before = len(rt._cache)
    hs = sdp.grouped_allreduce_async(mine, [f"fg.{i}" for i in range(len(mine))], op=sdp.Sum)
    outs = [h.wait() for h in hs]
    checks.append(("values", all(o.shape == a.shape and o.dtype == a.dtype and np.array_equal(o, w)
                                 for o, a, w in zip(outs, mine, want))))
    checks.append(("aligned views", all(o.size == 0 or o.ctypes.data % 64 == 0 for o in outs[:len(shapes)])))
    checks.append(("one request per dtype", len(rt._cache) - before == 3))
    one = sdp.grouped_allreduce_async([np.full(4, r + i, np.float32) for i in range(6)],
                                      [f"og.{i}" for i in range(6)], op=sdp.Sum)  # (one group: C makes the handles)
    checks.append(("one group's handles", [h.name for h in one] == [f"og.{i}" for i in range(6)] and all(
        np.array_equal(h.wait(), np.full(4, sum(q + i for q in range(n)), np.float32)) for i, h in enumerate(one))))
    # the same total size, other shapes on the last rank
    bad = [np.ones((2, 3), np.float32), np.ones(4, np.float32)] if r != n - 1 else \
        [np.ones((3, 2), np.float32), np.ones(4, np.float32)]
    try:
        [h.wait() for h in sdp.grouped_allreduce_async(bad, ["bad.0", "bad.1"])]
        checks.append(("mismatch raised", False))
    except TensorMismatchError as e:
        checks.append(("mismatch raised", "shapes of the grouped tensors" in str(e) and "[[2, 3], [4]]" in str(e)
                       and "[[3, 2], [4]]" in str(e) and "'bad.0 (+1) #" in str(e)))
    # the last rank joins; the others' group gets its zeros
    if r == n - 1:
        sdp.join()
    else:
        got = sdp.grouped_allreduce([np.full((2, 2), 1.0, np.float32), np.full(5, 2.0, np.float32)], name="jg",
                                    op=sdp.Sum)
        checks.append(("joined rank's zeros", np.array_equal(got[0], np.full((2, 2), n - 1.0, np.float32))
                       and np.array_equal(got[1], np.full(5, 2.0 * (n - 1), np.float32))))
        sdp.join()
    return checks
