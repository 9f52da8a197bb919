"""Worker functions for tests/test_config.py: the engine's settings as read from the environment."""
import numpy as np

import sdp
from sdp.common.config import bucket_cap_mb_to_bytes

ELEMS = 1000  # float32: 4000 bytes per tensor


def _data(rank, i, step):
    """Integer-valued float32 (sums are exact) that differs per rank, tensor and step."""
    return np.arange(ELEMS, dtype=np.float32) * (rank + 1) + (i + 10 * step)


def lists(k, steps, bucket_cap_mb=None):
    """``steps`` gradient lists of ``k`` float32 tensors, each list submitted at once
    (``grouped_allreduce_async``), then ``steps`` lists of ``allreduce_async`` calls.  With
    ``bucket_cap_mb``, every rank first sets the fusion buffer from it as ``DistributedOptimizer``
    does.  Returns the threshold and cycle time the engine holds, the collectives this rank ran
    for each grouped list, and whether every result equals numpy's sum."""
    if bucket_cap_mb is not None:
        sdp.api.set_fusion_threshold(bucket_cap_mb_to_bytes(bucket_cap_mb))
    n, r = sdp.size(), sdp.rank()
    rt = sdp.api.runtime()
    sdp.barrier()
    ok, per_list = True, []
    for step in range(steps):
        c0 = rt._seq
        hs = sdp.grouped_allreduce_async([_data(r, i, step) for i in range(k)], [f"g{i}" for i in range(k)],
                                         op=sdp.Sum)
        outs = [h.wait() for h in hs]
        per_list.append(rt._seq - c0)
        for i, out in enumerate(outs):
            ok = ok and np.array_equal(out, sum(_data(q, i, step) for q in range(n)))
    for step in range(steps):
        hs = [sdp.allreduce_async(_data(r, i, step), name=f"a{i}", op=sdp.Sum) for i in range(k)]
        for i, h in enumerate(hs):
            ok = ok and np.array_equal(h.wait(), sum(_data(q, i, step) for q in range(n)))
    return {"threshold": sdp.api.fusion_threshold(), "cycle_ms": rt.config.cycle_time_ms,
            "per_list": per_list, "ok": bool(ok)}


def blas_threads():
    """[cores, this rank's share of them (cores // local size), numpy's BLAS thread counts]."""
    import os

    from threadpoolctl import threadpool_info
    cores = len(os.sched_getaffinity(0))
    return [cores, max(1, cores // sdp.local_size()),
            [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]]
