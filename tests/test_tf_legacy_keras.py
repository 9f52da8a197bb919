"""sdp.tensorflow.keras with tf_keras (Keras 2, TF_USE_LEGACY_KERAS=1) across 2 real processes."""
import importlib.util

import numpy as np
import pytest

from harness import check_ok, run_cases
from test_tf_keras import aggregation_reference

pytest.importorskip("tensorflow")
if importlib.util.find_spec("tf_keras") is None:
    pytest.skip("tf_keras is not installed (pip install --no-deps tf_keras)", allow_module_level=True)

pytestmark = pytest.mark.tf
LEGACY = {"TF_USE_LEGACY_KERAS": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-rank launch with tf_keras for both tests below."""
    return run_cases(2, [("suite", "workers_tf_keras:legacy_keras_suite", [4]), ("hooks", "workers_tf_keras:legacy_hooks", [2]),
                         ("fit_callbacks", "workers_tf_keras:fit_callbacks_save_resume",
                          [str(tmp_path_factory.mktemp("fit_callbacks")), 3])], env=LEGACY, timeout=400)


def _assert_weights(a, b, **kw):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


def test_horovods_optimizer_hooks(runs):
    """Issue 54: ``_compute_gradients`` (reduced gradients, applied as they are) and
    ``_agg_helper`` (its ``counter``) on the tf_keras DistributedOptimizer."""
    for v in check_ok(runs["hooks"]):
        for kind in ("sgd", "legacy_sgd"):
            grads, x, no_helper = v[kind]
            assert grads == [3.0, 3.0] and np.allclose(x, [0.7, 1.7]) and no_helper, (kind, v[kind])
        counters, x = v["aggregation"]
        assert counters == [1, 0, 1] and np.allclose(x, [0.7]), v["aggregation"]


def test_tf_keras_optimizers_match_single_process(runs):
    values = check_ok(runs["suite"])
    for key in ("sgd", "legacy_sgd", "legacy_adam"):
        v0, v1 = values[0][key], values[1][key]
        _assert_weights(v0["weights"], v1["weights"], rtol=0, atol=0)
        _assert_weights(v0["weights"], v0["reference"], rtol=1e-4, atol=1e-5)
    for v in values:
        for key in ("sgd", "legacy_sgd"):
            assert v[key]["is_sgd"] and v[key]["iterations"] == 4 and v[key]["n_vars_called"] >= 1
        for key in ("aggregation", "legacy_aggregation"):
            trace, iterations = v[key]
            np.testing.assert_allclose(trace, aggregation_reference(4), rtol=1e-6, err_msg=key)
            assert iterations == 4, key


def test_tf_keras_fit_with_callbacks_then_load_model_resumes(runs):
    values = check_ok(runs["fit_callbacks"])
    v0, v1 = values
    assert v0["history"] == v1["history"]
    steps = 6
    want = [0.05 / 2 * ((e + (b + 1) / steps) / 2 + 1) for e in range(2) for b in range(steps)]
    want += [0.05 * 0.5 ** 2] * steps
    for v in values:
        np.testing.assert_allclose(v["lrs"], want, rtol=1e-6)
        assert v["iterations"] == 18 and v["loaded_iterations"] == 18 and v["resumed_iterations"] == 24
        assert v["loaded_weights_equal"] and v["loaded_is_distributed"] and v["loaded_class"] == "SGD"
    assert v0["best_saved"]
    _assert_weights(v0["weights"], v1["weights"], rtol=0, atol=0)
    _assert_weights(v0["resumed_weights"], v1["resumed_weights"], rtol=0, atol=0)
