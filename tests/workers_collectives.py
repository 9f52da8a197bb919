"""Worker functions run inside real rank processes by tests/harness.py."""
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
    hs = sdp.grouped_allreduce_async([np.ones(10, np.float32) * i for i in range(5)], [f"g{i}" for i in range(5)])
    [h.wait() for h in hs]
    sdp.broadcast(np.ones(3), 0, name="bc")
    sdp.stop_timeline()
    if sdp.rank() != 0:
        return None
    with open(path) as f:
        events = json.load(f)
    return sorted({(e["name"], e["ph"]) for e in events if e["ph"] in "BE"})
