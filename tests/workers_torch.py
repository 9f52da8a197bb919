"""Worker functions of tests/test_torch.py, run inside real rank processes by tests/harness.py."""
import numpy as np
import torch

import sdp
from sdp.torch import tensors

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}


def adapter_allreduce(dtypes):
    """Each dtype: an allreduce (Sum) through the adapter, and one written into the caller's own
    tensor (``out=`` its numpy view).  Returns [[dtype, equal, in place, same memory], ...]."""
    out, r, n = [], sdp.rank(), sdp.size()
    for name in dtypes:
        dt = TORCH_DTYPES[name]
        t = (torch.arange(12, dtype=torch.float64).reshape(3, 4) * (r + 1)).to(dt)
        want = (torch.arange(12, dtype=torch.float64).reshape(3, 4) * (n * (n + 1) // 2)).to(dt)
        got = tensors.as_tensor(sdp.allreduce(tensors.as_input(t), name=f"a.{name}", op=sdp.Sum))
        mine = t.clone()
        view = tensors.out_array(mine)
        res = sdp.allreduce(view, name=f"b.{name}", op=sdp.Sum, out=view)
        same = tensors.copy_into(mine, res) is mine and np.shares_memory(res, view)
        out.append([name, bool(got.dtype == dt and torch.equal(got, want)), bool(torch.equal(mine, want)), bool(same)])
    return out
