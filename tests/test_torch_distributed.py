"""The ``torch.distributed`` backend ``sdp`` and SMDDP's PyTorch names, over real processes
(tests/harness.py): every collective at 2 and 3 ranks, DDP over sdp bit for bit equal to DDP over
Gloo, mismatches raised on every rank, ``smdistributed.dataparallel.torch`` under --compat."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch.distributed backend needs torch (the torch extra)")

from harness import check_ok, run_cases, run_workers  # noqa: E402
from sdp.common.compat_names import SHIM_DIR  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from mnist_data import find_mnist_dir  # noqa: E402

MNIST = find_mnist_dir()

# Gloo (the baseline) on loopback only; one thread per rank on a shared machine
ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One launch of 2 ranks for every 2-rank case (each makes and destroys its own default
    group); SMDDP's and KungFu's names are enabled (--compat smddp,kungfu), which the other cases
    ignore."""
    store = str(tmp_path_factory.mktemp("torch_store") / "store")
    env = dict(ENV, SDP_COMPAT="smddp,kungfu",  # (smddp: smdistributed's short name)
               PYTHONPATH=os.pathsep.join(p for p in (SHIM_DIR, os.environ.get("PYTHONPATH")) if p))
    return run_cases(2, [("collectives", "workers_torch_distributed:collectives", []),
                         ("mismatches", "workers_torch_distributed:mismatches", []),
                         ("ddp", "workers_torch_distributed:ddp_sdp_and_gloo", [store, 6]),
                         ("ddp modes", "workers_torch_distributed:ddp_modes", [4]),
                         ("smddp", "workers_torch_distributed:smddp_names", []),
                         ("kungfu", "workers_torch_distributed:kungfu_torch", []),
                         ("benchmark", "workers_torch_distributed:benchmark_table", [])], env=env, init=False)


def _collectives_ok(values):
    for rank, checks in enumerate(values):
        bad = [k for k, good in checks.items() if not good]
        assert not bad and len(checks) > 40, (rank, bad)


def test_every_collective_of_the_process_group_2_ranks(two_ranks):
    """``init_process_group(backend="sdp")`` with nothing but sdp's environment (no MASTER_ADDR,
    sdp not started before: the backend starts it)."""
    _collectives_ok(check_ok(two_ranks["collectives"]))


def test_every_collective_of_the_process_group_3_ranks():
    _collectives_ok(check_ok(run_workers(3, "workers_torch_distributed:collectives", [], env=ENV, init=False)))


def test_ddp_over_sdp_matches_ddp_over_gloo_bit_for_bit(two_ranks):
    """The same seeded training, DDP over the default (sdp) group and over a Gloo group of the
    same job: equal weights, bit for bit, on every rank, and the weights moved."""
    values = check_ok(two_ranks["ddp"])
    (start, over_sdp), (start_gloo, over_gloo) = values[0]
    assert start == start_gloo and over_sdp != start
    assert over_sdp == over_gloo, values
    assert values[1] == values[0], values  # and every rank holds the same weights


def test_ddp_modes_and_comm_hooks(two_ranks):
    """DDP's options, its fp16 and PowerSGD comm hooks (PowerSGD waits on a collective inside a
    future's callback) and join() with uneven inputs: the ranks end with equal weights."""
    first, second = check_ok(two_ranks["ddp modes"])
    assert len(first) == 7 and first == second, (first, second)


def test_mismatches_raise_on_every_rank(two_ranks):
    for rank, out in enumerate(check_ok(two_ranks["mismatches"])):
        for key in ("shape", "kind", "dtype", "future"):
            assert out[key] is not None, (rank, key, out)
            assert out[key][0] == "TensorMismatchError" or "TensorMismatchError" in out[key][1], (rank, key, out)
        assert "rank" in out["shape"][1] and ("3" in out["shape"][1] and "4" in out["shape"][1]), out["shape"]
        assert out["after"] == [2.0, 2.0], (rank, out)


def test_smddp_torch_names_under_compat(two_ranks):
    for rank, out in enumerate(check_ok(two_ranks["smddp"])):
        assert out["same module"] and out["ddp class"] and out["available"] and out["group raises"], out
        assert not out["before init"] and out["initialized"], out
        assert (out["rank"], out["size"], out["local rank"]) == (rank, 2, rank), out
        assert out["average"] == [1.5] * 3 and out["sum"] == [1.0, 1.0], out
        assert out["broadcast"] == [1.0, 1.0] and out["all_gather"] == [0.0, 1.0], out
        assert out["ddp grad"] == [[3.0, 3.0, 3.0]], out
        assert out["smddp backend"] == ["smddp", [2.0, 2.0], str(rank)], out


@pytest.mark.skipif(MNIST is None, reason="MNIST not found: set SDP_MNIST_DIR or provide ../shared/data/mnist")
def test_ddp_mnist_example_two_ranks_agree_and_learn():
    """examples/torch_ddp_mnist.py under sdprun on real MNIST: it learns, and both ranks end with
    the same weights."""
    p = subprocess.run([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", sys.executable,
                        "examples/torch_ddp_mnist.py", "--data-dir", str(MNIST), "--steps", "100"],
                       cwd=ROOT, env=dict(os.environ, **ENV), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    acc = float(re.search(r"\[0\]<stdout>:test accuracy: ([0-9.]+)", p.stdout).group(1))
    sums = re.findall(r"\[(\d)\]<stdout>:weights checksum: ([0-9a-f]+)", p.stdout)
    assert acc >= 0.88, p.stdout[-2000:]
    assert len(sums) == 2 and sums[0][1] == sums[1][1], sums


def test_kungfu_torch_under_compat(two_ranks):
    """kungfu.torch's ops (sum by default) and SynchronousSGDOptimizer (summed gradients)."""
    for out in check_ok(two_ranks["kungfu"]):
        assert out["all_reduce_fn"] == [[3.0] * 3, [2.0] * 3, True], out  # new tensors, x untouched
        assert out["in place"] == [9.0] * 3, out  # summed (3), then the product of 3 and 3
        # the bias's gradient is 2 on each rank, summed (KungFu's default): 4; two steps of lr 0.1
        assert out["optimizer"][0] and abs(out["optimizer"][1] + 0.8) < 1e-6, out


def test_torch_benchmark_runs_and_prints_its_table(two_ranks):
    """benchmarks/torch_allreduce.py end to end (speed is the benchmark's business, not a test's)."""
    (rc, out), _ = check_ok(two_ranks["benchmark"])
    assert rc == 0
    row = re.search(r"^\s+1K((?:\s+(?:[0-9.]+\s+[0-9.]+|n/a)){4})$", out, re.M)
    assert row and "n/a" not in row.group(1), out
    assert re.search(r"DDP step .*: sdp backend [0-9.]+ ms, Gloo [0-9.]+ ms", out), out
    assert "DDP step over sdp <= 1.0x over Gloo" in out, out


def test_torch_benchmark_on_cuda_without_a_gpu_says_so_in_one_line(capsys):
    """``--device cuda`` (tests/gpu_run.sh's GPU rows) where torch sees no GPU: exit status 2 and
    one line, before any rank meets the others."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here: tests/gpu_run.sh runs the benchmark on it")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch_allreduce
    assert torch_allreduce.main(["--device", "cuda", "--sizes", "64M"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda: torch" in err and "sees no CUDA device" in err, err


def test_compat_smddp_is_smdistributed():
    from sdp.common.compat_names import parse_families
    from sdp.launcher.cli import _compat_list
    assert parse_families("smddp,kungfu") == ("smdistributed", "kungfu")
    assert _compat_list("smddp") == "smdistributed"


def _two_free_ports() -> int:
    """A port p on 127.0.0.1 with p + 1 free too (PyTorch's store and sdp's rendezvous)."""
    import socket
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", p + 1))
                    return p
            except OSError:
                continue
    raise RuntimeError("no two adjacent free ports")


def test_env_init_beside_pytorchs_store():
    """Launched as Kubeflow's PyTorchJob launches (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; no
    sdprun): PyTorch's TCPStore serves MASTER_PORT, sdp's rendezvous takes the next port."""
    port = _two_free_ports()
    sdp_vars = ("SDP_RANK", "SDP_SIZE", "SDP_LOCAL_RANK", "SDP_LOCAL_SIZE", "SDP_CROSS_RANK", "SDP_CROSS_SIZE",
                "SDP_RENDEZVOUS_ADDR")

    def launcher_env(rank):
        return dict({v: None for v in sdp_vars}, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    values = check_ok(run_workers(2, "workers_torch_distributed:launched_like_kubeflow", [], env=ENV, init=False,
                                  per_rank_env=launcher_env))
    assert values == [["TORCHRUN", [3.0, 3.0]]] * 2, values
