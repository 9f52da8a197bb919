"""KungFu's graph collectives hold no TensorFlow thread while they wait for peers: 30 independent
``all_reduce`` ops, created in a different order on each worker, finish in a ``tf.function`` with
one inter-op thread (with blocking ``py_function`` ops this deadlocks: each worker's only thread
waits in a collective the other worker has not reached)."""
import numpy as np

from harness import check_ok, run_workers
from workers_kungfu_graph import data
from workers_tf_graph import creation_order

N_OPS, SIZE = 30, 2


def test_independent_all_reduces_in_rank_dependent_order_finish_with_one_thread():
    assert creation_order(N_OPS, 0) != creation_order(N_OPS, 1)
    values = check_ok(run_workers(SIZE, "workers_kungfu_graph:all_reduces", [N_OPS, 1], timeout=120))
    for v in values:
        assert v["threads"] == 1 and v["seconds"] < 30, v["seconds"]
        assert len(v["results"]) == 2
        for step in v["results"]:
            for i, got in enumerate(step):
                np.testing.assert_array_equal(got, sum(data(i, r) for r in range(SIZE)), err_msg=f"op {i}")
