"""Graphs holding many independent collectives, created in a different order on each rank, finish
with TensorFlow's default inter-op pool and with one inter-op thread (issue 19, item 3): sdp's wait
ops run on tf.data iterator threads, so no inter-op thread is parked waiting for a peer.  Also the
eager path (direct engine calls): values and gradients."""
import numpy as np
import pytest

from harness import check_ok, run_cases
from workers_tf_graph import KINDS, creation_order, data

N_OPS, SIZE = 35, 2


@pytest.fixture(scope="module")
def runs():
    """One launch per inter-op pool size (set once per process, before TensorFlow starts): the
    rank-dependent graphs, then Horovod's first-batch broadcast step, and with the default pool
    the eager path too; 2 launches instead of 5.  {threads: {case: [WorkerResult per rank]}}."""
    return {threads: run_cases(SIZE, [("graphs", "workers_tf_graph:graphs", [N_OPS, threads]),
                                      ("first_batch_broadcast", "workers_tf_graph:first_batch_broadcast", [threads]),
                                      *([("eager", "workers_tf_graph:eager_gradients", [])] if not threads else [])],
                               timeout=240)
            for threads in (1, 0)}


def expected(i, rank, size=SIZE):
    """numpy reference for op ``i`` of workers_tf_graph, as seen on ``rank``."""
    kind = KINDS[i % len(KINDS)]
    xs = [data(i, r) for r in range(size)]
    if kind == "allgather":  # (rank r has r + 1 rows)
        return [np.concatenate(xs)]
    total = np.sum(xs, axis=0)
    if kind == "allreduce":
        return [total]
    if kind == "broadcast":
        return [xs[i % size]]
    if kind == "grouped":
        return [total / size, 2 * total / size]
    if kind == "grouped_sparse":
        dense = np.zeros((4, 2), np.float32)
        for r in range(size):
            dense[r] += xs[r][0]
        return [total, dense]
    rows = 4 // size
    if kind == "reducescatter":
        return [total[rank * rows:(rank + 1) * rows]]
    return [np.concatenate([x[rank * rows:(rank + 1) * rows] for x in xs])]  # alltoall, equal splits


def test_creation_orders_differ():
    assert creation_order(N_OPS, 0) != creation_order(N_OPS, 1)
    assert sorted(creation_order(N_OPS, 1)) == list(range(N_OPS))


@pytest.mark.parametrize("threads", [1, 0], ids=["inter_op_1", "inter_op_default"])
def test_independent_collectives_in_rank_dependent_order_finish(threads, runs):
    values = check_ok(runs[threads]["graphs"])
    for rank, v in enumerate(values):
        if threads:
            assert v["threads"] == threads
        for mode in ("function", "session"):
            assert v[f"{mode}_s"] < 30, (mode, v[f"{mode}_s"])
            assert len(v[mode]) == 2  # two steps: the wait ops' iterators serve every step
            for step in v[mode]:
                assert len(step) == N_OPS
                for i, got in enumerate(step):
                    want = expected(i, rank)
                    assert len(got) == len(want), (mode, i)
                    for g, w in zip(got, want):
                        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6,
                                                   err_msg=f"rank {rank} {mode} op {i} ({KINDS[i % len(KINDS)]})")


def test_eager_collectives_and_gradients(runs):
    values = check_ok(runs[0]["eager"])
    xs = [data(0, r) for r in range(SIZE)]
    for rank, v in enumerate(values):
        x = xs[rank]
        np.testing.assert_allclose(v["allreduce"], np.sum(xs, axis=0))
        np.testing.assert_allclose(v["grouped"][0], np.mean(xs, axis=0))
        np.testing.assert_allclose(v["grouped"][1], 3 * np.mean(xs, axis=0))
        np.testing.assert_allclose(v["allgather"], np.concatenate([xs[r][: r + 1] for r in range(SIZE)]))
        np.testing.assert_allclose(v["broadcast"], xs[1])
        # d/dx_rank sum(allreduce_sum(x*x)): the gradient is itself allreduced (SUM of the ones
        # coming back from every rank) times 2x: 2 * size * x
        np.testing.assert_allclose(v["grad_allreduce"], 2 * SIZE * x, rtol=1e-6)
        # d/dx sum(avg(x)) + sum(avg(5x)): the averaged ones, times 1 and 5
        np.testing.assert_allclose(v["grad_grouped"], np.full_like(x, 6.0), rtol=1e-6)
        np.testing.assert_allclose(v["tape"], np.mean([data(2, r) for r in range(SIZE)], axis=0), rtol=1e-6)
        assert v["is_tensor"]


@pytest.mark.parametrize("threads", [1, 0], ids=["inter_op_1", "inter_op_default"])
def test_horovod_first_batch_broadcast_in_the_training_step(threads, runs):
    """Horovod's TF2 examples broadcast the variables inside the ``tf.function`` step, after
    ``apply_gradients`` of the allreduced gradients: the broadcast's submit op reads variables
    the blocking op's results updated, so ordering it before that op would be a cycle
    ("nodes in a cycle" when TensorFlow runs the function)."""
    values = check_ok(runs[threads]["first_batch_broadcast"])
    assert values[0]["initial"] != values[1]["initial"]  # the broadcast has something to do
    for v in values:
        if threads:
            assert v["threads"] == threads
        assert v["seconds"] < 30
        assert all(np.isfinite(v["losses"]))
        assert v["final"] != v["initial"]
    for a, b in zip(values[0]["final"], values[1]["final"]):  # rank 0's start, the same averaged steps
        np.testing.assert_allclose(a, b, rtol=1e-6)
