"""The KungFu bridge (sdp_kungfu_bridge) across 2 real processes: ops against numpy references,
the distributed optimizers, the initializers, Keras fit, and clear elastic errors without -w."""
import numpy as np
import pytest

from harness import check_ok, run_cases, run_workers

tf = pytest.importorskip("tensorflow")


@pytest.fixture(scope="module")
def runs():
    """One 2-rank launch for every test here but the pair-averaging timing one: the ops, the
    optimizers, Keras fit, the elastic errors, then finalize and init again (last: it ends sdp)."""
    return run_cases(2, [(k, f"workers_kungfu:{k}", []) for k in
                         ("ops_check", "optimizers_all", "keras_check", "elastic_errors", "finalize_check")],
                     timeout=300)


@pytest.fixture(scope="module")
def ops2(runs):
    return check_ok(runs["ops_check"])


def _x(r):
    return np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * r


def test_cluster_info(ops2):
    for r, v in enumerate(ops2):
        assert (v["rank"], v["size"], v["local_rank"], v["local_size"]) == (r, 2, r, 2)
        assert v["detached"] is False and v["peer_info"] == [r, 2]
        assert v["other_ranks"] == [1 - r]
    assert ops2[0]["uid"] != ops2[1]["uid"]


def test_collectives_match_numpy(ops2):
    xs = np.stack([_x(0), _x(1)])
    for v in ops2:
        np.testing.assert_allclose(v["all_reduce_sum"], xs.sum(0))
        np.testing.assert_allclose(v["all_reduce_min"], xs.min(0))
        np.testing.assert_allclose(v["all_reduce_max"], xs.max(0))
        np.testing.assert_allclose(v["all_reduce_prod"], xs.prod(0))
        np.testing.assert_allclose(v["group"][0], xs.sum(0))
        assert v["group"][1] is None and v["group"][2] == 3
        np.testing.assert_allclose(v["all_gather"], xs)
        np.testing.assert_allclose(v["broadcast"], xs[0])
        assert v["consensus_diff"] is False and v["consensus_same"] is True
        assert v["int_max"] == 8
        for traced in v["traced"]:  # the same traced function, run twice
            np.testing.assert_allclose(traced[0], xs.sum(0))
            np.testing.assert_allclose(traced[1], xs)
            np.testing.assert_allclose(traced[2], xs[0])
            assert traced[3] == 2


def test_state_ops(ops2):
    for v in ops2:
        assert v["counter_eager"] == [0, 5]
        assert v["counter_traced"] == [[0, 5], [1, 7], [2, 9]]
        assert v["schedule"] == [1, 1, 3, 3, 1, 1]  # '1:2,3:2', then the default 1
        assert v["defuse_ok"]


def test_model_store_save_and_request(ops2):
    for r, v in enumerate(ops2):
        peer = _x(1 - r)
        np.testing.assert_allclose(v["request"], peer)
        np.testing.assert_allclose(v["request_v3"], 2 * peer)
        np.testing.assert_allclose(v["request_latest"], 3 * peer)
        np.testing.assert_allclose(v["request_template"], np.full([2, 3], 10.0 * (1 - r)))
        assert v["request_missing"] is not None  # an error, not a hang


def test_global_noise_scale_matches_numpy(ops2):
    def est(gs, gb, bs=8.0, bb=32.0):
        s2, b2 = np.sum(np.square(gs)), np.sum(np.square(gb))
        return (bb * b2 - bs * s2) / (bb - bs), (s2 - b2) / (1 / bs - 1 / bb)

    gs, gb = np.array([1.0, 2, 3]), np.array([0.5, 1, 1])
    g1, s1 = est(gs, gb)
    g2, s2 = est(2 * gs, gb)
    expected = [s1 / g1, (0.5 * s1 + 0.5 * s2) / (0.5 * g1 + 0.5 * g2)]
    for v in ops2:
        np.testing.assert_allclose(v["gns"], expected, rtol=1e-5)


def test_initializers(ops2):
    for v in ops2:
        assert v["bcast_eager"] == [1.0, 1.0, 1.0]
        assert v["bcast_traced"] == [5.0, 5.0]
        assert v["session"] == [[1.0, 1.0], [2.0, 1.0]]  # BroadcastGlobalVariablesOp, graph all_reduce
        assert v["hook"] == [2.0, 2.0]  # BroadcastGlobalVariablesHook in a MonitoredSession


def test_session_minimize_with_wrapped_v1_optimizers(ops2):
    for v in ops2:
        runs = v["session_optimizers"]
        for algo, run in runs.items():
            assert run["start"] == [1.0, 1.0, 1.0], algo  # after BroadcastGlobalVariablesOp
            assert run["end"][0] != run["start"], algo  # it trained
        # S-SGD keeps the workers identical
        assert runs["SynchronousSGDOptimizer"]["end"][0] == runs["SynchronousSGDOptimizer"]["end"][1]


@pytest.fixture(scope="module")
def optim2(runs):
    return check_ok(runs["optimizers_all"])


def _linear_grads(w, b, x, y):
    err = x @ w + b - y
    scale = 2.0 / err.size
    return scale * x.T @ err, scale * err.sum(0)


@pytest.mark.parametrize("key", ["ssgd", "ssgd_v1"])
def test_synchronous_sgd_matches_numpy(optim2, key):
    runs = [v[key] for v in optim2]  # the ranks start from different weights (no broadcast)
    for i in range(len(runs[0]["grads"])):
        local = [_linear_grads(*(np.array(a) for a in run["weights"][i]), np.array(run["x"][i]),
                               np.array(run["y"][i])) for run in runs]
        avg = [(local[0][k] + local[1][k]) / 2 for k in range(2)]
        for run, mine in zip(runs, local):
            for k in range(2):
                np.testing.assert_allclose(run["grads"][i][k], mine[k], rtol=1e-4, atol=1e-6)
                expected = np.array(run["weights"][i][k]) - 0.1 * avg[k]
                np.testing.assert_allclose(run["weights"][i + 1][k], expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("key", ["sma", "sma_v1"])
def test_sma_identical_models_after_each_averaging(optim2, key):
    runs = [v[key] for v in optim2]
    steps = len(runs[0]["grads"])
    for i in range(steps):
        before = [[np.array(a) for a in run["weights"][i]] for run in runs]
        mean = [(before[0][k] + before[1][k]) / 2 for k in range(2)]
        for run in runs:
            # undo this rank's local SGD step: what is left is the averaged model
            averaged = [np.array(run["weights"][i + 1][k]) + 0.1 * np.array(run["grads"][i][k]) for k in range(2)]
            for k in range(2):
                np.testing.assert_allclose(averaged[k], mean[k], rtol=1e-5, atol=1e-6)
    assert runs[0]["n_opt_vars"] == runs[1]["n_opt_vars"]


def test_pair_averaging_does_not_wait_for_a_slow_peer_and_converges():
    steps, sleep_s = 8, 0.25
    values = check_ok(run_workers(2, "workers_kungfu:pair_avg_check", [1, sleep_s, steps], timeout=180))
    fast, slow = values
    assert slow["elapsed"] >= steps * sleep_s
    assert fast["elapsed"] < steps * sleep_s / 2, fast["elapsed"]  # not paced by the sleeper
    assert fast["pulls"] == slow["pulls"] == steps + 1
    init = np.array(fast["initial"])
    final = np.array(fast["final"])
    assert np.linalg.norm(final[0] - final[1]) < 0.1 * np.linalg.norm(init[0] - init[1])


def test_keras_fit_with_wrapped_optimizers_and_broadcast_callback(runs):
    values = check_ok(runs["keras_check"])
    for v in values:
        assert v["SynchronousSGDOptimizer"] == {"same": True, "iterations": 6}
        assert v["SynchronousAveragingOptimizer"]["iterations"] == 6
        gns = v["MonitorGradientNoiseScaleOptimizer"]
        assert gns["same"] and gns["iterations"] == 6 and np.isfinite(gns["noise_scale"])


def test_elastic_errors_without_watch_mode(runs):
    values = check_ok(runs["elastic_errors"])
    for v in values:
        assert v["same_size"] == [False, False]
        assert v["no_server"][0] == "ResizeError" and "sdprun -w" in v["no_server"][1]
        assert v["disagree"][0] == "ResizeError" and "[2, 3]" in v["disagree"][1]
        assert v["from_url"][0] == "ResizeError" and "config server" in v["from_url"][1]
        assert v["propose"][0] == "ElasticError"
        assert v["size_after"] == 2 and v["detached"] is False


def test_finalize_then_init(runs):
    values = check_ok(runs["finalize_check"])
    for r, v in enumerate(values):
        assert (v["rank_after"], v["size_after"]) == (r, 2)
        assert "finalize()" in v["barrier"] and v["max"] == 1
