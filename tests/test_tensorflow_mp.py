"""sdp.tensorflow across 2 real processes."""
import numpy as np
import pytest

from harness import check_ok, run_cases, run_workers

tf = pytest.importorskip("tensorflow")


@pytest.fixture(scope="module")
def runs():
    """One 2-rank launch (the default environment) for the tape test and the fp16 case without a wire."""
    return run_cases(2, [("tape", "workers_tf:tape_in_tf_function", [3]), ("fp16", "workers_tf:fp16_wire_dtype", [])],
                     timeout=240)


def test_distributed_gradient_tape_in_tf_function_averages(runs):
    values = check_ok(runs["tape"])
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
def test_fp16_compression_only_where_there_is_a_wire(slab, wire, runs):
    """Gradient reducers: over ZeroMQ (SDP_SHM_SLAB_BYTES=0 stands in for a network) fp16 halves
    the bytes; between ranks sharing memory it would only cost, so gradients stay float32.
    Compression.fp16 itself keeps Horovod's contract (always float16)."""
    if slab:  # the engine reads SDP_SHM_SLAB_BYTES at init: a launch of its own
        results = run_workers(2, "workers_tf:fp16_wire_dtype", [], env={"SDP_SHM_SLAB_BYTES": slab}, timeout=120)
    else:
        results = runs["fp16"]
    for w, contract, out_dtype, vals in check_ok(results):
        assert w == wire and contract == "float16" and out_dtype == "float32" and vals == [2.0, 4.0]
