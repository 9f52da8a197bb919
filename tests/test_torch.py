"""sdp.torch: Horovod's PyTorch API on sdp's engine, over real processes (tests/harness.py).

Each launch runs many checks (``run_cases``): torch's import costs seconds per process."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch face needs torch (the torch extra)")

from harness import check_ok, run_cases  # noqa: E402
from sdp.torch import tensors  # noqa: E402

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64"]
DYNAMIC = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}


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
    with pytest.raises(ValueError, match="complex64 is not supported"):
        tensors.as_input(torch.ones(2, dtype=torch.complex64))
    mine = torch.zeros(2, 3)
    assert tensors.copy_into(mine, np.ones((2, 3), np.float32)) is mine and bool((mine == 1).all())


def _no_problems(runs, key):
    for rank, problems in enumerate(check_ok(runs[key])):
        assert not problems, f"{key}, rank {rank}: {problems}"


OPTIMIZER_CASES = [("passes", "workers_torch:optimizer_passes", [2, 3]),
                   ("groups", "workers_torch:optimizer_passes", [2, 2, 2]),
                   ("checks", "workers_torch:optimizer_checks", []),
                   ("state", "workers_torch:optimizer_state", []),
                   ("sync batch norm", "workers_torch:sync_batch_norm", []),
                   ("sparse", "workers_torch:optimizer_sparse", []),
                   ("adasum", "workers_torch:optimizer_adasum", [])]
_two = {}


def _two_ranks():
    """One launch of 2 ranks for the collectives' and the optimizer's cases (torch's import and
    the job's start paid once)."""
    if not _two:
        _two.update(run_cases(2, _collective_cases(2) + OPTIMIZER_CASES, env=DYNAMIC))
    return _two


def _collective_cases(n):
    cases = [("named", "workers_torch:named_allreduce", [DTYPES]),  # (first: the collectives' join() turns the
             # fast lane off for good)
             ("adapter", "workers_torch:adapter_allreduce", [DTYPES]),
             ("collectives", "workers_torch:collectives", [DTYPES]),
             ("gradients", "workers_torch:gradients", [["float32", "float64"]])]
    if n == 3:
        cases.append(("sets and errors", "workers_torch:process_set_and_errors", []))
    return cases


@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_collective_and_its_gradient(n):
    """Every collective on float16/bfloat16/float32/float64/int32/int64, out of place, in place, async
    with poll + synchronize, grouped; a named allreduce again and again (the compiled entry from
    sdp.torch.allreduce: exact, new tensors that keep their values); Horovod's gradients through each
    (float32/float64); Adasum at 1 and 2 ranks; at 3 ranks also a process set, and mismatches raised on
    every rank as HorovodInternalError."""
    runs = _two_ranks() if n == 2 else run_cases(n, _collective_cases(n), env=DYNAMIC)
    for rank, cases_ in enumerate(check_ok(runs["adapter"])):
        for name, equal, in_place, same in cases_:
            assert equal and in_place and same, (rank, name, equal, in_place, same)
    _no_problems(runs, "collectives")
    _no_problems(runs, "gradients")
    for rank, (problems, entered, has_front) in enumerate(check_ok(runs["named"])):
        assert not problems, (rank, problems)
        assert entered > 0 or not has_front, (rank, entered)  # (sdp.torch.allreduce entered the compiled entry)
    if n == 3:
        for rank, (problems, errors) in enumerate(check_ok(runs["sets and errors"])):
            assert not problems, (rank, problems)
            assert [e[:3] for e in errors] == [[w, "TensorMismatchError", True] for w in ("shape", "dtype", "root")]
            assert "rank 2 has [3]" in errors[0][3] and "root rank mismatch" in errors[2][3], errors


def test_distributed_optimizer_and_optimizer_state():
    """DistributedOptimizer with backward_passes_per_step=2 (allreduces started by the gradient
    hooks during the last backward pass; per parameter and in 2 groups) equals one process
    training on the concatenated batches, and so do sparse gradients (as allgathers, and with
    sparse_as_dense); with op=Adasum each parameter moves by the Adasum of the ranks' local
    steps (Horovod's Adasum optimizer); Horovod's argument checks; broadcast_optimizer_state
    of SGD with momentum and of Adam (tensor step, learning rates) gives every rank rank 0's;
    SyncBatchNorm over batches of different sizes equals BatchNorm over their concatenation."""
    runs = _two_ranks()
    for key in ("passes", "groups"):
        for rank, (problems, diff) in enumerate(check_ok(runs[key])):
            assert not problems and diff < 1e-12, (key, rank, problems, diff)
    _no_problems(runs, "checks")
    _no_problems(runs, "sync batch norm")
    for rank, (problems, diff) in enumerate(check_ok(runs["adasum"])):
        assert not problems and diff < 1e-12, (rank, problems, diff)
    for rank, (problems, diffs) in enumerate(check_ok(runs["sparse"])):
        assert not problems and max(diffs) < 1e-12, (rank, problems, diffs)
    (p0, sums0), (p1, sums1) = check_ok(runs["state"])
    assert not p0 and not p1 and sums0 == sums1, (p0, p1, sums0, sums1)


# the names horovod/torch/__init__.py (Horovod 0.28) exports
HOROVOD_TORCH_NAMES = """elastic Compression allgather_object broadcast_object broadcast_optimizer_state
broadcast_parameters allreduce allreduce_async allreduce_ allreduce_async_ grouped_allreduce
grouped_allreduce_async grouped_allreduce_ grouped_allreduce_async_ sparse_allreduce_async allgather allgather_async
grouped_allgather grouped_allgather_async
broadcast broadcast_async broadcast_ broadcast_async_ alltoall alltoall_async reducescatter reducescatter_async
grouped_reducescatter grouped_reducescatter_async join barrier poll synchronize init shutdown is_initialized
start_timeline stop_timeline size local_size cross_size rank local_rank cross_rank mpi_threads_supported mpi_enabled
mpi_built gloo_enabled gloo_built nccl_built ddl_built ccl_built cuda_built rocm_built ProcessSet global_process_set
add_process_set remove_process_set Average Sum Adasum Min Max Product HorovodInternalError DistributedOptimizer
SyncBatchNorm""".split()


def test_horovod_torch_names_and_modules():
    """Every name of ``horovod.torch`` is in sdp.torch; ``horovod.torch`` and its submodules are
    sdp.torch's under the horovod compatibility names (tests/test_compat.py checks the mechanism)."""
    import sdp.torch as hvd
    from sdp.compat import _CompatFinder, _FAMILY_DEFS
    assert [n for n in HOROVOD_TORCH_NAMES if not hasattr(hvd, n)] == []
    assert {"TorchState", "ElasticSampler", "run"} <= set(dir(hvd.elastic))
    finder = _CompatFinder()
    for alias, target in _FAMILY_DEFS["horovod"].aliases:
        finder.aliases[alias] = (target, "horovod")
    for sub in ("", ".mpi_ops", ".functions", ".compression", ".optimizer", ".sync_batch_norm", ".elastic",
                ".elastic.state", ".elastic.sampler"):
        target = finder.map("horovod.torch" + sub)[0]
        assert target == "sdp.torch" + sub
        __import__(target)
