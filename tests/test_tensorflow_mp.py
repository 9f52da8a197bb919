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


@pytest.mark.parametrize("slab,wire", [("0", "float16"), (None, "float32")])
def test_fp16_compression_only_where_there_is_a_wire(slab, wire):
    """Gradient reducers: over ZeroMQ (SDP_SHM_SLAB_BYTES=0 stands in for a network) fp16 halves
    the bytes; between ranks sharing memory it would only cost, so gradients stay float32.
    Compression.fp16 itself keeps Horovod's contract (always float16)."""
    env = {"SDP_SHM_SLAB_BYTES": slab} if slab else None
    for w, contract, out_dtype, vals in check_ok(run_workers(2, "workers_tf:fp16_wire_dtype", [], env=env,
                                                             timeout=120)):
        assert w == wire and contract == "float16" and out_dtype == "float32" and vals == [2.0, 4.0]
