"""sdp.torch with CUDA tensors on a real GPU (marker ``gpu``; ``tests/gpu_run.sh`` runs it):
skipped, with the reason, without torch, a CUDA build of it, PyCUDA or a device.  Two processes
share the one GPU, as in tests/test_gpu.py."""
import glob
import importlib.util

import pytest

from harness import check_ok, run_cases

pytestmark = [pytest.mark.gpu]


def _why():
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if importlib.util.find_spec("pycuda") is None:
        return "PyCUDA is not installed"
    if not glob.glob("/dev/nvidia[0-9]*"):
        return "no CUDA device (/dev/nvidia0)"
    import torch
    return None if torch.cuda.is_available() else f"torch {torch.__version__} sees no CUDA device"


_reason = _why()
needs_gpu = pytest.mark.skipif(_reason is not None, reason=_reason or "")
DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64"]


@needs_gpu
@pytest.mark.parametrize("ipc", ["1", "0"])
def test_cuda_tensors_every_collective_gradient_and_optimizer(ipc):
    """The CPU tests' checks on CUDA tensors (results on the device, in place into the caller's
    tensor), through CUDA IPC and staged through host memory; the side-stream and no-copy checks."""
    runs = run_cases(2, [("collectives", "workers_torch:collectives", [DTYPES, "cuda"]),
                         ("gradients", "workers_torch:gradients", [["float32", "float64"], "cuda"]),
                         ("optimizer", "workers_torch:optimizer_passes", [2, 3, None, "cuda"]),
                         ("streams", "workers_torch:cuda_streams_and_copies", [])],
                     env={"SDP_GPU_IPC": ipc}, timeout=300)
    for key in ("collectives", "gradients", "streams"):
        for rank, problems in enumerate(check_ok(runs[key])):
            assert not problems, (key, rank, problems)
    for rank, (problems, diff) in enumerate(check_ok(runs["optimizer"])):
        assert not problems and diff < 1e-12, (rank, problems, diff)
