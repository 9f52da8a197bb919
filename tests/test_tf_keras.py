"""sdp.tensorflow.keras (Keras 3): DistributedOptimizer, callbacks and load_model across 2 real
processes, against single-process training and hand-computed references."""
import numpy as np
import pytest

from harness import check_ok, run_cases

pytest.importorskip("tensorflow")

pytestmark = pytest.mark.tf


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-rank launch for every test below (Keras 3), XLA's last; one launch instead of 6."""
    return run_cases(2, [*((f"sgd_fit {k}", "workers_tf_keras:sgd_fit_matches_single_process", [5, False, k])
                           for k in (1, 4)),
                         ("adam", "workers_tf_keras:adam_custom_loop", [4]),
                         ("aggregation", "workers_tf_keras:aggregation_and_sparse", [4]),
                         ("fit_callbacks", "workers_tf_keras:fit_callbacks_save_resume",
                          [str(tmp_path_factory.mktemp("fit_callbacks")), 3]),
                         ("xla", "workers_tf_keras:xla", [2])], timeout=400)


def _assert_weights(a, b, **kw):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_sgd_fit_equals_single_process_on_concatenated_batches(steps_per_execution, runs):
    values = check_ok(runs[f"sgd_fit {steps_per_execution}"])
    _assert_weights(values[0]["weights"], values[1]["weights"], rtol=0, atol=0)
    _assert_weights(values[0]["weights"], values[0]["reference"], rtol=1e-5, atol=1e-6)
    for v in values:
        assert v["is_sgd"] and v["iterations"] == 5 and v["n_vars_called"] == 2


def test_adam_apply_gradients_in_tf_function_equals_single_process(runs):
    values = check_ok(runs["adam"])
    _assert_weights(values[0]["weights"], values[1]["weights"], rtol=0, atol=0)
    _assert_weights(values[0]["weights"], values[0]["reference"], rtol=1e-4, atol=1e-5)


def aggregation_reference(passes):
    """w after each pass: SGD(0.1) every 2nd pass on the mean over ranks and passes of
    gradient (r + 1) * [1, 2, 3] * (pass + 1), starting from ones."""
    w, acc, trace = np.ones(3), np.zeros(3), []
    for p in range(passes):
        acc += np.mean([(r + 1) * np.arange(1, 4) * (p + 1) for r in range(2)], axis=0)
        if p % 2 == 1:
            w = w - 0.1 * acc / 2
            acc[:] = 0
        trace.append(w.copy())
    return trace


def test_backward_passes_per_step_and_sparse_gradients(runs):
    values = check_ok(runs["aggregation"])
    want = aggregation_reference(4)
    for v in values:
        np.testing.assert_allclose(v["agg_trace"], want, rtol=1e-6)
        assert v["agg_iterations"] == 4
        assert v["sparse"]["sparse_grad"] is True
        _assert_weights(v["sparse"]["weights"], values[0]["reference"], rtol=1e-5, atol=1e-6)
        _assert_weights(v["dense"]["weights"], values[0]["reference"], rtol=1e-5, atol=1e-6)


def test_fit_with_callbacks_then_load_model_resumes(runs):
    values = check_ok(runs["fit_callbacks"])
    v0, v1 = values
    assert v0["history"] == v1["history"]  # MetricAverageCallback: every rank logs the averages
    assert set(v0["history"]) >= {"loss", "mae", "val_loss", "val_mae", "lr"}
    steps = 6
    want = [0.05 / 2 * ((e + (b + 1) / steps) * (2 - 1) / 2 + 1) for e in range(2) for b in range(steps)]
    want += [0.05 * 0.5 ** 2] * steps
    for v in values:
        np.testing.assert_allclose(v["lrs"], want, rtol=1e-6)
        np.testing.assert_allclose(v["history"]["lr"], [want[steps - 1], want[2 * steps - 1], want[-1]], rtol=1e-6)
        assert v["iterations"] == 18 and v["loaded_iterations"] == 18 and v["resumed_iterations"] == 24
        assert v["loaded_weights_equal"] and v["loaded_is_distributed"] and v["loaded_class"] == "SGD"
    assert v0["best_saved"]
    _assert_weights(v0["weights"], v1["weights"], rtol=0, atol=0)
    _assert_weights(v0["resumed_weights"], v1["resumed_weights"], rtol=0, atol=0)
    assert not np.allclose(np.asarray(v0["resumed_weights"][0]), np.asarray(v0["weights"][0]))


def test_jit_compile_is_turned_off_by_callback_or_raises_a_clear_error(runs):
    values = check_ok(runs["xla"])
    for v in values:
        assert v["warned"] and v["jit_after"] is False
        assert v["error"] == "XlaNotSupportedError", v.get("message")
        assert "jit_compile=False" in v["message"]
