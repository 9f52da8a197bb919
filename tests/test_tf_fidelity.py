"""Horovod's behaviour where a real script or test notices it (issue 31), across 2 real processes:
gradients of every collective (eager, tf.function, TF1 graphs, process sets), TensorFlow's error
classes."""
import numpy as np
import pytest

from harness import check_ok, run_workers
from workers_tf_fidelity import upstream

pytest.importorskip("tensorflow")

pytestmark = pytest.mark.tf


def _expected_gradients(n=2):
    """Horovod's gradients (horovod/tensorflow/mpi_ops.py) of the cases of workers_tf_fidelity
    for ranks 0..n-1, from the upstream gradients: {case: [grad of rank 0, grad of rank 1]}."""
    exp = {}
    rows = [r + 1 for r in range(n)]
    dy = [upstream((sum(rows), 2), r) for r in range(n)]
    mean = sum(dy) / n
    starts = np.cumsum([0] + rows)
    exp["allgather"] = [mean[starts[r]:starts[r + 1]] for r in range(n)]
    exp["grouped_allgather"] = [2 * g for g in exp["allgather"]]
    dyb = [upstream((5, 2), r) for r in range(n)]
    meanb = sum(dyb) / n
    exp["broadcast0"] = [meanb if r == 0 else 0 * meanb for r in range(n)]
    exp["broadcast_last"] = [meanb if r == n - 1 else 0 * meanb for r in range(n)]
    blocks = [3, 2]  # 5 rows over 2 ranks: the lower rank gets the extra row
    dys = np.concatenate([upstream((blocks[r], 2), r) for r in range(n)])
    exp["reducescatter_sum"] = [n * dys] * n
    exp["reducescatter_avg"] = [dys] * n
    # alltoall: rank 0 sends splits [1, 2], rank 1 [2, 1]; so rank 0 receives 1 + 2 rows, rank 1 2 + 1
    recv = [[1, 2], [2, 1]]
    dya = [upstream((3, 2), r) for r in range(n)]
    back = []
    for r in range(n):  # rows of rank r's input went to rank j at j's offset for sender r
        parts = []
        for j in range(n):
            off = sum(recv[j][:r])
            parts.append(dya[j][off:off + recv[j][r]])
        back.append(np.concatenate(parts))
    exp["alltoall"] = back
    return exp


@pytest.mark.parametrize("mode", ["eager", "function", "v1"])
def test_gradients_of_every_collective(mode):
    """Issue 31 item 1: before, tape.gradient through allgather/broadcast/alltoall/reducescatter
    returned None (and tf.gradients in a TF1 graph too)."""
    values = check_ok(run_workers(2, "workers_tf_fidelity:gradients", [mode], timeout=240))
    exp = _expected_gradients()
    for r, v in enumerate(values):
        for case, want in exp.items():
            got = v[f"{case}@0"]
            assert got is not None, (mode, case, r)
            np.testing.assert_allclose(np.asarray(got), want[r], err_msg=f"{mode} {case} rank {r}")


@pytest.mark.parametrize("mode", ["eager", "v1"])
def test_gradients_on_process_sets(mode):
    """The same gradients on a process set of every rank, and on a set of one rank (there the
    gradient of allgather/broadcast/reducescatter is the upstream gradient itself, Sum times 1)."""
    values = check_ok(run_workers(2, "workers_tf_fidelity:gradients", [mode, True], timeout=240,
                                  env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}))
    exp = _expected_gradients()
    for r, v in enumerate(values):
        for case, want in exp.items():
            np.testing.assert_allclose(np.asarray(v[f"{case}@0"]), want[r], err_msg=f"{mode} {case} rank {r}")
    for r, v in enumerate(values):  # alone in a set: the upstream gradient itself (Sum times 1)
        np.testing.assert_allclose(v["allgather@1"], upstream((r + 1, 2), r))
        np.testing.assert_allclose(v["broadcast0@1"], upstream((5, 2), r))
        np.testing.assert_allclose(v["reducescatter_sum@1"], upstream((5, 2), r))
        assert "alltoall@1" not in v
