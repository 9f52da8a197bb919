"""``op=Adasum`` (sdp.engine.adasum) on real ranks against a numpy tree reduction written here from
the formula ``a (1 - a.b / 2|a|^2) + b (1 - a.b / 2|b|^2)``, per tensor, with Horovod's conventions
(a squared norm under sqrt(DBL_MIN) counts as zero: coefficient 1; float64 dot products; float16
combined in float32, float32 in float64, rounded once per level)."""
import base64

import numpy as np
import pytest

from harness import check_ok, run_cases, run_workers
from test_hierarchical_mp import fake_hosts
from workers_adasum import B0, DTYPES, LR, W0, inputs, linear_data

CASES = ["single", "async", "grouped", "large", "zeros", "device"]
DEVICE = {"SDP_DEVICE_BACKEND": "numpy"}  # device arrays: host memory standing in (tests/test_device.py)
HOROVOD_RANKS = "Running Adasum with non-power of 2 ranks is not supported yet."  # (Horovod's text, then sdp's)


def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    dot, asq, bsq = a64 @ b64, a64 @ a64, b64 @ b64
    zero = np.sqrt(np.finfo(np.float64).tiny)  # Horovod's sqrt(DBL_MIN)
    ca = 1.0 - dot / asq / 2 if asq >= zero else 1.0
    cb = 1.0 - dot / bsq / 2 if bsq >= zero else 1.0
    acc = np.float32 if a.dtype == np.float16 else np.float64
    return (acc(ca) * a.astype(acc) + acc(cb) * b.astype(acc)).astype(a.dtype)


def tree(per_rank: list) -> list:
    """Adasum of every rank's tensors (``per_rank[r]``: rank r's list): pairs of neighbours, then
    pairs of pairs, ..."""
    level = per_rank
    while len(level) > 1:
        level = [[adasum_pair(a, b) for a, b in zip(level[i], level[i + 1])] for i in range(0, len(level), 2)]
    return level[0]


def host_average(xs: list) -> list:
    """The average of one host's ranks' tensors (16-bit floats summed and scaled in float32)."""
    acc = [np.float32 if x.dtype == np.float16 else x.dtype.type for x in xs[0]]
    return [(sum(x[i].astype(a) for x in xs) * a(1.0 / len(xs))).astype(xs[0][i].dtype)
            for i, a in enumerate(acc)]


def decode(encoded) -> list:
    return [np.frombuffer(base64.b64decode(b), np.dtype(d)).reshape(s) for d, s, b in encoded]


def check_against(values, expect_of) -> None:
    """Every rank's results bit-identical to rank 0's and close to ``expect_of(case, dtype)``."""
    for case in values[0]:
        if case == "paths":
            continue
        for dtype in DTYPES:
            got = [decode(v[case][dtype]) for v in values]
            for r, g in enumerate(got[1:], 1):
                assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(got[0], g)), (case, dtype, r)
            for i, (g, e) in enumerate(zip(got[0], expect_of(case, dtype))):
                scale = float(np.max(np.abs(e.astype(np.float64)))) if e.size else 1.0
                tol = {"float16": 4e-3, "float32": 1e-6, "float64": 1e-12}[dtype]
                np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=tol, atol=tol * scale,
                                           err_msg=f"{case} {dtype} tensor {i}")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_adasum_equals_the_tree_reduction(n):
    """1, 2 and 4 ranks on one host, float16/32/64, through allreduce, allreduce_async, a flattened
    group of tensors of norms 1e-3 to 1e3, arrays the engine fuses, zero tensors, device arrays
    (staged through host memory); no fast path ran them; refused inputs (2 ranks)."""
    cases = [("run", "workers_adasum:run", [CASES])] + ([("bad", "workers_adasum:bad_input", [])] if n == 2 else [])
    runs = run_cases(n, cases, timeout=150, env=DEVICE)
    values = check_ok(runs["run"])
    check_against(values, lambda case, dtype: tree([inputs(case, r, dtype) for r in range(n)]))
    assert all(v["paths"] == [0, 0, 0] for v in values), [v["paths"] for v in values]
    if n == 2:  # (the test can fail: neither the sum nor the average)
        a, b = inputs("single", 0, "float64")[0], inputs("single", 1, "float64")[0]
        got = decode(values[0]["single"]["float64"])[0]
        assert not np.allclose(got, a + b) and not np.allclose(got, (a + b) / 2)
        bad = check_ok(runs["bad"])[0]
        assert bad[0][0] == "ValueError" and "Adasum" in bad[0][1] and "int32" in bad[0][1], bad
        assert bad[1][0] == "ValueError" and "reducescatter" in bad[1][1], bad
        assert bad[2] == ["NotImplementedError", "Adasum does not support non-global process sets yet. (process set 1)"]


@pytest.mark.parametrize("hierarchical", [False, True])
def test_adasum_across_two_fake_hosts_of_two(hierarchical):
    """2 x 2 ranks on fake hosts: by default Adasum over all four ranks (Horovod's MPI op); with
    SDP_HIERARCHICAL=1 each host's average, then Adasum of the two hosts' (Horovod's NCCL build)."""
    n, per_rank = fake_hosts([2, 2])
    env = {"SDP_HIERARCHICAL": "1", **DEVICE} if hierarchical else DEVICE
    values = check_ok(run_workers(n, "workers_adasum:run", [["single", "grouped", "zeros", "device"]], timeout=150,
                                  env=env, per_rank_env=per_rank))

    def expect(case, dtype):
        xs = [inputs(case, r, dtype) for r in range(n)]
        return tree([host_average(xs[0:2]), host_average(xs[2:4])]) if hierarchical else tree(xs)

    check_against(values, expect)


def test_adasum_refuses_three_ranks_on_every_rank():
    """3 ranks: every rank raises Horovod's NotImplementedError from every entry at once, with
    nothing sent; the job goes on (a Sum allreduce after it)."""
    for r, got in enumerate(check_ok(run_workers(3, "workers_adasum:refused", timeout=90))):
        assert [g[0] for g in got[:4]] == ["NotImplementedError"] * 4, (r, got)
        assert all(g[1].startswith(HOROVOD_RANKS) and "size() is 3" in g[1] for g in got[:4]), (r, got)
        assert got[4] == 3.0, (r, got)


def test_hierarchical_adasum_refuses_three_hosts():
    """SDP_HIERARCHICAL=1 on 2 + 1 + 1 ranks (4 ranks, 3 hosts): Horovod's error for a number of
    nodes that is not a power of two, on every rank."""
    n, per_rank = fake_hosts([2, 1, 1])
    for r, got in enumerate(check_ok(run_workers(n, "workers_adasum:refused", timeout=90,
                                                 env={"SDP_HIERARCHICAL": "1"}, per_rank_env=per_rank))):
        assert all(g[0] == "NotImplementedError" and g[1].startswith(
            "Running Adasum with non-power of 2 nodes is not supported yet.") and "3 hosts" in g[1]
            for g in got[:4]), (r, got)
        assert got[4] == 4.0, (r, got)


def _linear_grads(X, y, w, b):
    """The gradient of sum((X w + b - y)^2) at (w, b), float32 inputs, in float64."""
    res = X.astype(np.float64) @ np.asarray(w, np.float64) + np.float64(b) - y
    return 2 * X.T.astype(np.float64) @ res, 2 * res.sum()


def _sgd(rank, w, b, steps):
    """``steps`` local steps of gradient descent from (w, b) on rank ``rank``'s batch (float32)."""
    X, y = linear_data(rank)
    w, b = np.asarray(w, np.float32), np.float32(b)
    for _ in range(steps):
        gw, gb = _linear_grads(X, y, w, b)
        w, b = (w - np.float32(LR) * gw.astype(np.float32)), np.float32(b - np.float32(LR) * np.float32(gb))
    return w, b


def _delta_step(w, b, steps):
    """Horovod's delta optimizer on 2 ranks: each rank's change after ``steps`` local steps,
    combined by Adasum per variable, added to the start."""
    local = [_sgd(r, w, b, steps) for r in range(2)]
    dw = adasum_pair(local[0][0] - np.float32(w), local[1][0] - np.float32(w))
    db = adasum_pair(np.asarray(local[0][1] - np.float32(b)), np.asarray(local[1][1] - np.float32(b)))
    return np.float32(w) + dw, np.float32(b) + db, local


def test_tensorflow_face_with_adasum():
    """hvd.allreduce / grouped_allreduce (tf.function) / DistributedGradientTape / DistributedOptimizer
    (a tf.compat.v1 optimizer: Horovod's delta optimizer, eagerly and in a TF1 graph with 2 passes
    per step) with op=hvd.Adasum on 2 ranks, against the reference; Horovod's errors."""
    pytest.importorskip("tensorflow")
    values = check_ok(run_workers(2, "workers_adasum:tf_face", timeout=240))
    for dtype in DTYPES:
        xs = [inputs("single", r, dtype) + inputs("grouped", r, dtype)[:3] for r in range(2)]
        want = tree(xs)
        for v in values:
            got = decode(v[f"allreduce.{dtype}"]) + decode(v[f"grouped.{dtype}"])
            tol = {"float16": 4e-3, "float32": 1e-6, "float64": 1e-12}[dtype]
            for g, e in zip(got, want):
                np.testing.assert_allclose(g, e, rtol=tol, atol=tol * float(np.max(np.abs(e))), err_msg=dtype)
    local = [_linear_grads(*linear_data(r), W0, B0) for r in range(2)]
    for v in values:
        gw, gb = decode(v["tape"])
        np.testing.assert_allclose(gw, adasum_pair(local[0][0].astype(np.float32), local[1][0].astype(np.float32)),
                                   rtol=1e-5)
        np.testing.assert_allclose(gb, adasum_pair(np.float32([local[0][1]]), np.float32([local[1][1]]))[0],
                                   rtol=1e-5)
    w1, b1, _ = _delta_step(W0, B0, 1)
    w2, b2, _ = _delta_step(w1, b1, 1)
    g2w, g2b, _ = _delta_step(W0, B0, 2)
    for r, v in enumerate(values):
        ew, eb = decode(v["optimizer.eager"])
        np.testing.assert_allclose(ew, w2, rtol=1e-5)
        np.testing.assert_allclose(eb, b2, rtol=1e-5)
        seen = [decode(s) for s in v["optimizer.graph"]]
        np.testing.assert_allclose(seen[0][0], _sgd(r, W0, B0, 1)[0], rtol=1e-5)  # (a local pass only)
        np.testing.assert_allclose(seen[1][0], g2w, rtol=1e-5)
        np.testing.assert_allclose(seen[1][1], g2b, rtol=1e-5)
        np.testing.assert_allclose(seen[3][0], _delta_step(g2w, g2b, 2)[0], rtol=1e-5)
        e = v["errors"]
        assert e["keras"] == ["ValueError", "op == Adasum is not supported yet with Keras"], e
        assert e["sparse"][0] == "NotImplementedError" and "sparse_as_dense=True" in e["sparse"][1], e
        assert e["reducescatter"][0] == "NotImplementedError", e
        assert e["averaged"] == ["ValueError", "Adasum does not support average_aggregated_gradients == True"], e
        assert e["int"][0] == "ValueError" and "Adasum" in e["int"][1], e
