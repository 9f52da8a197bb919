"""sdp.torch: Horovod's PyTorch API on sdp's engine, over real processes (tests/harness.py)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch face needs torch (the torch extra)")

from harness import check_ok, run_workers  # noqa: E402
from sdp.torch import tensors  # noqa: E402


def test_adapter_shares_memory_both_ways():
    """CPU tensors become numpy views of their own memory and results come back as tensors over
    the result's memory, bfloat16 through its bits; non-contiguous tensors are copied first."""
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.bool):
        t = torch.ones(3, 4, dtype=dt, requires_grad=dt.is_floating_point)
        arr = tensors.as_input(t)
        assert arr.shape == (3, 4) and arr.ctypes.data == t.data_ptr(), dt
        back = tensors.as_tensor(arr)
        assert back.dtype == dt and back.data_ptr() == t.data_ptr(), dt
    assert tensors.as_input(torch.ones(2, dtype=torch.bfloat16)).dtype.name == "bfloat16"
    t = torch.arange(6.0).reshape(2, 3).t()
    assert np.array_equal(tensors.as_input(t), t.numpy()) and tensors.out_array(t) is None
    with pytest.raises(TypeError, match="complex64 is not supported"):
        tensors.as_input(torch.ones(2, dtype=torch.complex64))
    mine = torch.zeros(2, 3)
    assert tensors.copy_into(mine, np.ones((2, 3), np.float32)) is mine and bool((mine == 1).all())


@pytest.mark.parametrize("n", [1, 3])
def test_adapter_through_the_engine(n):
    values = check_ok(run_workers(n, "workers_torch:adapter_allreduce",
                                  [["float16", "bfloat16", "float32", "float64", "int32", "int64"]]))
    for rank, cases in enumerate(values):
        for name, equal, in_place, same in cases:
            assert equal and in_place and same, (rank, name, equal, in_place, same)
