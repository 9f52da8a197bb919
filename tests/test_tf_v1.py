"""TF1 style across 2 real processes: tf.compat.v1 graph, MonitoredTrainingSession,
BroadcastGlobalVariablesHook and DistributedOptimizer over tf.compat.v1.train.GradientDescentOptimizer."""
import numpy as np
import pytest

from harness import check_ok, run_cases

pytest.importorskip("tensorflow")

pytestmark = pytest.mark.tf


@pytest.fixture(scope="module")
def runs():
    """One 2-rank launch for both numbers of passes (each case builds its own graph)."""
    return run_cases(2, [(p, "workers_tf_v1:monitored_session", [4, p]) for p in (1, 2)], timeout=240)


@pytest.mark.parametrize("passes", [1, 2])
def test_monitored_session_with_hook_equals_single_process_gd(passes, runs):
    values = check_ok(runs[passes])
    v0, v1 = values
    assert v0["w0"] == v1["w0"]  # the hook broadcast rank 0's initial weights
    assert v0["w"] == v1["w"]
    np.testing.assert_allclose(v0["w"], v0["reference"], rtol=1e-5, atol=1e-6)
    for r, v in enumerate(values):
        assert v["global_step"] == 4
        assert v["ops"] == [r, 2, 3.0]
    assert all(v["fusion_threshold"] == 1 << 20 for v in values)  # bucket_cap_mb=1 reached the engine
