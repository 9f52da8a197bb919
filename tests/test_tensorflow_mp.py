"""sdp.tensorflow across 2 real processes."""
import numpy as np
import pytest

from harness import check_ok, run_workers

tf = pytest.importorskip("tensorflow")


def test_distributed_gradient_tape_in_tf_function_averages():
    values = check_ok(run_workers(2, "workers_tf:tape_in_tf_function", [3], timeout=180))
    w0 = np.ones([3, 2], np.float32)  # rank 0's initial weights, broadcast to both
    np.testing.assert_allclose(values[1]["w"], w0)
    grads = []
    for r in range(2):
        x = np.arange(6, dtype=np.float32).reshape(2, 3) + r
        grads.append(2 * x.T @ (x @ w0))  # d/dw sum((xw)^2)
    expected = np.mean(grads, axis=0)
    for v in values:
        np.testing.assert_allclose(v["grad"], expected, rtol=1e-5)
