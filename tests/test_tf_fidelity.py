"""Horovod's behaviour where a real script or test notices it (issue 31), across 2 real processes:
gradients of every collective (eager, tf.function, TF1 graphs, process sets), TensorFlow's error
classes."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from harness import check_ok, run_cases, run_workers
from workers_tf_fidelity import upstream

pytest.importorskip("tensorflow")

pytestmark = pytest.mark.tf
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sdprun(args, compat=None, hosts=None, cwd=None, timeout=300, **extra):
    """``sdprun -np 2 [-H hosts] [--compat compat] python *args`` with a clean environment plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "SDP_"))}
    env.update(PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="", **extra)
    argv = [sys.executable, "-m", "sdp.launcher.cli", "-np", "2"] + (["-H", hosts] if hosts else [])
    argv += (["--compat", compat] if compat else []) + [sys.executable, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd or REPO)


def _per_rank(stdout, pattern):
    """{rank: re.Match} of the first match of ``pattern`` in each rank's stdout lines."""
    out = {}
    for line in stdout.splitlines():
        head, _, rest = line.partition("<stdout>:")
        m = re.search(pattern, rest)
        if m and head.startswith("[") and int(head.strip("[]")) not in out:
            out[int(head.strip("[]"))] = m
    return out


def _mnist_dir():
    """The shared MNIST IDX files (../shared/data/mnist from the project root), else skip."""
    mnist = os.path.join(REPO, "..", "shared", "data", "mnist")
    if not os.path.exists(os.path.join(mnist, "train-images-idx3-ubyte.gz")):
        pytest.skip(f"MNIST IDX files not found in {mnist}")
    return mnist


def _json_per_rank(res, tag):
    """{rank: the JSON each rank printed after ``tag``}; asserts sdprun succeeded on both ranks."""
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    found = {r: json.loads(m.group(1)) for r, m in _per_rank(res.stdout, "^" + tag + " (.*)$").items()}
    assert sorted(found) == [0, 1], res.stdout[-3000:]
    return found


def _expected_gradients(n=2):
    """Horovod's gradients (horovod/tensorflow/mpi_ops.py) of the cases of workers_tf_fidelity
    for ranks 0..n-1, from the upstream gradients: {case: [grad of rank 0, grad of rank 1]}."""
    exp = {}
    rows = [r + 1 for r in range(n)]
    dy = [upstream((sum(rows), 2), r) for r in range(n)]
    mean = sum(dy) / n
    starts = np.cumsum([0] + rows)
    exp["allgather"] = [mean[starts[r]:starts[r + 1]] for r in range(n)]
    exp["grouped_allgather"] = [2 * g for g in exp["allgather"]]
    dyb = [upstream((5, 2), r) for r in range(n)]
    meanb = sum(dyb) / n
    exp["broadcast0"] = [meanb if r == 0 else 0 * meanb for r in range(n)]
    exp["broadcast_last"] = [meanb if r == n - 1 else 0 * meanb for r in range(n)]
    blocks = [3, 2]  # 5 rows over 2 ranks: the lower rank gets the extra row
    dys = np.concatenate([upstream((blocks[r], 2), r) for r in range(n)])
    exp["reducescatter_sum"] = [n * dys] * n
    exp["reducescatter_avg"] = [dys] * n
    # alltoall: rank 0 sends splits [1, 2], rank 1 [2, 1]; so rank 0 receives 1 + 2 rows, rank 1 2 + 1
    recv = [[1, 2], [2, 1]]
    dya = [upstream((3, 2), r) for r in range(n)]
    back = []
    for r in range(n):  # rows of rank r's input went to rank j at j's offset for sender r
        parts = []
        for j in range(n):
            off = sum(recv[j][:r])
            parts.append(dya[j][off:off + recv[j][r]])
        back.append(np.concatenate(parts))
    exp["alltoall"] = back
    return exp


@pytest.fixture(scope="module")
def plain_runs():
    """One 2-rank launch for the cases below that need no process-wide setting: the gradients of
    every collective per mode, get_local_and_global_gradients per mode, the Keras 3 callback case
    (each a key of its own; one launch instead of six)."""
    return run_cases(2, [*((f"gradients {m}", "workers_tf_fidelity:gradients", [m]) for m in ("eager", "function", "v1")),
                         *((f"local_and_global {m}", "workers_tf_fidelity:local_and_global", [m])
                           for m in ("eager", "function")),
                         ("keras_lazy_model keras3", "workers_tf_fidelity:keras_lazy_model", [3]),
                         ("repeated gradients v1", "workers_tf_fidelity:repeated_gradients", [5])],
                     env={"TF_USE_LEGACY_KERAS": "0"}, timeout=300)


@pytest.fixture(scope="module")
def dynamic_set_runs():
    """One 2-rank launch with HOROVOD_DYNAMIC_PROCESS_SETS=1: the gradients on process sets per
    mode.  (The error-class tests keep a launch per mode: each adds a set of rank 0 alone.)"""
    return run_cases(2, [(f"set gradients {m}", "workers_tf_fidelity:gradients", [m, True]) for m in ("eager", "v1")],
                     env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}, timeout=300)


@pytest.mark.parametrize("mode", ["eager", "function", "v1"])
def test_gradients_of_every_collective(mode, plain_runs):
    """Issue 31 item 1: before, tape.gradient through allgather/broadcast/alltoall/reducescatter
    returned None (and tf.gradients in a TF1 graph too)."""
    values = check_ok(plain_runs[f"gradients {mode}"])
    exp = _expected_gradients()
    for r, v in enumerate(values):
        for case, want in exp.items():
            got = v[f"{case}@0"]
            assert got is not None, (mode, case, r)
            np.testing.assert_allclose(np.asarray(got), want[r], err_msg=f"{mode} {case} rank {r}")


def test_gradients_built_several_times_in_one_graph(plain_runs):
    """Issue 54: five tf.gradients of one collective evaluated in one Session.run; before, the
    gradients' collectives had one name ('... .grad.sizes' is already in flight)."""
    values = check_ok(plain_runs["repeated gradients v1"])
    exp = _expected_gradients()
    for r, v in enumerate(values):
        for case, want in exp.items():
            assert len(v[case]) == 5, (case, r)
            for got in v[case]:
                np.testing.assert_allclose(np.asarray(got), want[r], err_msg=f"{case} rank {r}")


@pytest.mark.parametrize("mode", ["eager", "v1"])
def test_gradients_on_process_sets(mode, dynamic_set_runs):
    """The same gradients on a process set of every rank, and on a set of one rank (there the
    gradient of allgather/broadcast/reducescatter is the upstream gradient itself, Sum times 1)."""
    values = check_ok(dynamic_set_runs[f"set gradients {mode}"])
    exp = _expected_gradients()
    for r, v in enumerate(values):
        for case, want in exp.items():
            np.testing.assert_allclose(np.asarray(v[f"{case}@0"]), want[r], err_msg=f"{mode} {case} rank {r}")
    for r, v in enumerate(values):  # alone in a set: the upstream gradient itself (Sum times 1)
        np.testing.assert_allclose(v["allgather@1"], upstream((r + 1, 2), r))
        np.testing.assert_allclose(v["broadcast0@1"], upstream((5, 2), r))
        np.testing.assert_allclose(v["reducescatter_sum@1"], upstream((5, 2), r))
        assert "alltoall@1" not in v


def _check_error_messages(v):
    """sdp's message (tensor name, ranks, values) in each case's error, whatever its class."""
    assert "shape mismatch, rank 0 has [1], rank 1 has [2]" in v["shape"][1], v["shape"]
    assert "dtype mismatch" in v["dtype"][1] and "float64" in v["dtype"][1], v["dtype"]
    assert "root" in v["root"][1], v["root"]
    assert "splits" in v["splits"][1] and "rank 1" in v["splits"][1], v["splits"]


@pytest.mark.parametrize("mode", ["eager", "function", "v1", "data"])
def test_error_classes_are_horovods(mode):
    """Issue 31 item 2: a mismatch across ranks is tf.errors.FailedPreconditionError and bad alltoall
    splits tf.errors.InvalidArgumentError, on every rank, with sdp's message: eagerly (then also
    sdp's TensorMismatchError, an SdpError), in a tf.function, in a TF1 Session and in a tf.data
    map (sdp's compiled SdpCheck op sets the status).  Before: TensorMismatchError (a ValueError)
    eagerly, InvalidArgumentError for everything in graphs.  A rank outside a process set gets
    InvalidArgumentError in every mode."""
    values = check_ok(run_workers(2, "workers_tf_fidelity:error_classes", [mode], timeout=240,
                                  env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}))
    for r, v in enumerate(values):
        if mode == "eager":
            for case in ("shape", "dtype", "root"):
                assert v[case][0] == ["FailedPrecondition", "SdpError", "TensorMismatch"], (r, case, v[case])
            assert v["splits"][0] == ["InvalidArgument", "SdpError", "TensorMismatch"], v["splits"]
        else:  # the classes TensorFlow raises for a status: not sdp's
            for case in ("shape", "dtype", "root"):
                assert v[case][0] == ["FailedPrecondition"], (r, case, v[case])
            assert v["splits"][0] == ["InvalidArgument"], v["splits"]
            assert "shape_case" in v["shape"][1] and "dtype_case" in v["dtype"][1], v
        if mode != "data":  # issue 54: the status is sdp's text, not "Error in user-defined function
            for case in ("shape", "dtype", "root", "splits"):  # passed to MapDataset ..." (the wait op's)
                assert "user-defined function" not in v[case][1], (case, v[case][1][:300])
            lines = v["shape"][1].splitlines()  # (TensorFlow's own "{{function_node ...}}" may come first)
            assert any(re.match(r"(\{\{function_node [^}]*\}\} )?allreduce of 'shape_case': shape mismatch", ln)
                       for ln in lines), v["shape"][1]
        _check_error_messages(v)
    if mode == "function":  # after a failure the same op succeeds again, with the right values
        assert all(v["again"] == ["FailedPreconditionError", [[3.0] * 3] * 3] for v in values), values
    assert values[0]["outside_set"] == "no error"
    inv, is_value_error, is_sdp, msg = values[1]["outside_set"]
    assert inv and is_value_error and is_sdp and "rank 1 is not in process set" in msg
    if mode == "eager":  # Horovod: a rank outside the tape's / optimizer's set keeps its local gradients
        assert values[1]["tape_outside_set"] == [2.0, 2.0] and values[0]["tape_outside_set"] == [1.0, 1.0]
        assert values[1]["optimizer_outside_set"] == [[2.0, 2.0]]


@pytest.mark.parametrize("why", ["SDP_TF_OPS=0", "no compiler"])
def test_graph_errors_without_the_compiled_op(why, tmp_path):
    """Without sdp's compiled op (switched off, or no compiler to build it in an empty cache) graph
    collectives keep TensorFlow's class for a numpy_function's ValueError: InvalidArgumentError
    with sdp's message; the reason is logged once per rank when it was not switched off."""
    env = {"SDP_TF_OPS": "0"} if why == "SDP_TF_OPS=0" else {
        "SDP_CACHE_DIR": str(tmp_path), "CXX": str(tmp_path / "no-such-compiler")}
    results = run_workers(2, "workers_tf_fidelity:error_classes", ["function"], timeout=240,
                          env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1", **env})
    for res, v in zip(results, check_ok(results)):
        for case in ("shape", "dtype", "root", "splits"):
            assert v[case][0] == ["InvalidArgument"], (case, v[case])
        _check_error_messages(v)
        logged = res.stderr.count("sdp's compiled op is not loaded")
        if why == "no compiler":
            assert logged == 1 and "no C++ compiler" in res.stderr, res.stderr[-3000:]
        else:
            assert logged == 0, res.stderr[-3000:]
    assert not list(tmp_path.glob("tf_ops/*.so"))


def test_compiled_op_is_built_once_then_cached(tmp_path):
    """Two ranks whose cache holds no library build it on their first graph collective, once (the
    compiler is a wrapper that counts its runs; the other rank waits on the lock, then loads it);
    `python -m sdp.tensorflow.build_ops` then finds it in the cache, even with no compiler."""
    import shutil
    gxx = shutil.which("g++") or shutil.which("c++")
    if gxx is None:
        pytest.skip("no C++ compiler")
    count = tmp_path / "compiles"
    wrapper = tmp_path / "cxx.sh"
    wrapper.write_text(f'#!/bin/sh\necho run >> "{count}"\nexec "{gxx}" "$@"\n')
    wrapper.chmod(0o755)
    cache = tmp_path / "cache"
    values = check_ok(run_workers(2, "workers_tf_fidelity:error_classes", ["function"], timeout=240,
                                  env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1", "SDP_CACHE_DIR": str(cache),
                                       "CXX": str(wrapper)}))
    assert [v["shape"][0] for v in values] == [["FailedPrecondition"]] * 2
    assert count.read_text().splitlines() == ["run"]
    libs = list(cache.glob("tf_ops/*.so"))
    assert len(libs) == 1 and not list(cache.glob("tf_ops/*.tmp")), libs
    env = {k: v for k, v in os.environ.items() if k != "SDP_TF_OPS"}
    env.update(SDP_CACHE_DIR=str(cache), CXX=str(tmp_path / "no-such-compiler"), TF_CPP_MIN_LOG_LEVEL="3")
    res = subprocess.run([sys.executable, "-m", "sdp.tensorflow.build_ops"], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=240)
    assert res.returncode == 0 and f"sdp: cached {libs[0]}" in res.stdout, res.stdout + res.stderr
    res = subprocess.run([sys.executable, "-m", "sdp.tensorflow.build_ops", "--force"], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=240)
    assert res.returncode == 1 and "no C++ compiler" in res.stderr, res.stdout + res.stderr


def test_graph_error_class_comes_from_the_python_class_only():
    """Why sdp ships a compiled op for graph-mode errors (DESIGN.md, "TensorFlow's error classes"):
    a numpy_function / py_function kernel maps the Python class of the error, and a raised
    FailedPreconditionError becomes UnknownError, in a tf.function and in a tf.data map.  If
    TensorFlow starts reading an OpError's code, this fails: then the numpy_function could raise
    the TF class itself, without SdpCheck."""
    import tensorflow as tf

    def fail(cls):
        def fn(x):
            raise cls(None, None, "sdp message") if issubclass(cls, tf.errors.OpError) else cls("sdp message")
        return fn

    got = {}
    for kind in ("numpy_function", "py_function"):
        for cls in (tf.errors.FailedPreconditionError, ValueError):
            op = getattr(tf, kind)
            fn = fail(cls)
            f = tf.function(lambda x, op=op, fn=fn: op(fn, [x], tf.float32))
            data = tf.data.Dataset.from_tensors(tf.ones(2)).map(lambda x, op=op, fn=fn: op(fn, [x], tf.float32))
            for where, run in (("function", lambda: f(tf.ones(2))), ("tf.data", lambda: next(iter(data)))):
                try:
                    run()
                    got[kind, cls.__name__, where] = "no error"
                except tf.errors.OpError as e:
                    got[kind, cls.__name__, where] = type(e).__name__
                    assert "sdp message" in str(e)
    for (kind, cls, where), err in got.items():
        want = "InvalidArgumentError" if cls == "ValueError" else "UnknownError"
        assert err == want, (kind, cls, where, err)


@pytest.mark.parametrize("legacy", [False, True], ids=["keras3", "tf_keras"])
def test_keras_broadcast_callback_lazy_model_and_local_layers(legacy, request):
    """Issue 31 item 6: a Sequential built by its first batch (Horovod's Keras MNIST pattern)
    trains under BroadcastGlobalVariablesCallback (before: tf_keras raised "Weights for model
    'sequential' have not yet been created" at train begin) and ends with the same weights on
    every rank; local_variables= are not broadcast and PartialDistributedOptimizer keeps the local
    layer's gradients local (its weights differ per rank, the others agree)."""
    if legacy:
        pytest.importorskip("tf_keras")
    if legacy:  # TF_USE_LEGACY_KERAS is read once per process: a launch of its own
        values = check_ok(run_workers(2, "workers_tf_fidelity:keras_lazy_model", [3], timeout=240,
                                      env={"TF_USE_LEGACY_KERAS": "1"}))
    else:
        values = check_ok(request.getfixturevalue("plain_runs")["keras_lazy_model keras3"])
    a, b = values
    for wa, wb in zip(a["lazy"], b["lazy"]):
        np.testing.assert_array_equal(wa, wb)
    for wa, wb in zip(a["partial"][:2], b["partial"][:2]):  # the shared layer
        np.testing.assert_array_equal(wa, wb)
    assert not np.allclose(a["partial"][2], b["partial"][2])  # the local head: own init, own data
    assert a["bad_layer"] == "All local layers must be of tf.keras.layers.Layer type."


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_get_local_and_global_gradients(mode, plain_runs):
    """Horovod's DistributedGradientTape.get_local_and_global_gradients (horovod.tensorflow 0.28):
    ([(source, grad)] of registered local sources, [(source, grad)] of the others), in the order
    of the sources; local gradients are this rank's own (divided by size unless
    scale_local_gradients=False), the others averaged.  Before: AttributeError."""
    values = check_ok(plain_runs[f"local_and_global {mode}"])
    for r, v in enumerate(values):
        own, mean = r + 1.0, 1.5
        assert v["registered"] == [["local", "b", [own / 2]],
                                   ["global", "a", [mean, mean]], ["global", "c", [mean] * 3]], (r, v)
        assert v["unscaled"][0] == ["local", "b", [own]], (r, v)
        kinds = [(k, name.split("/")[-1]) for k, name, _ in v["partial"]]
        assert kinds == [("local", "kernel"), ("local", "bias"), ("global", "a"), ("global", "b")], kinds
        assert v["partial"][0][2] == [own / 2, own / 2] and v["partial"][1][2] == [own / 2], v["partial"]
        assert v["partial"][2][2] == [mean, mean] and v["partial"][3][2] == [mean], v["partial"]


@pytest.mark.parametrize("sdp_level", [None, "DEBUG"])
def test_sdp_logger_follows_sdp_log_level_not_the_root_logger(sdp_level):
    """Issue 31 item 9: with the script's root logger at DEBUG, sdp logs nothing below WARNING
    unless SDP_LOG_LEVEL asks for it (before: "sdp.security.zap DEBUG: auth received API command
    b'TERMINATE'" and other debug lines on every rank)."""
    env = {"SDP_LOG_LEVEL": sdp_level} if sdp_level else {}
    results = run_workers(2, "workers_tf_fidelity:root_logger_debug", env=env, init=False,
                          per_rank_env=lambda r: {} if sdp_level else {"SDP_LOG_LEVEL": None})
    levels = check_ok(results)
    sdp_debug = [ln for r in results for ln in r.stderr.splitlines() if ln.startswith("ROOT sdp") and " DEBUG " in ln]
    if sdp_level:
        assert levels == ["DEBUG", "DEBUG"] and sdp_debug  # the test can see them when asked for
    else:
        assert levels == ["WARNING", "WARNING"] and not sdp_debug, sdp_debug[:5]


ENV_PROBE = ("import json, os; print('ENV ' + json.dumps({k: v for k, v in os.environ.items() "
             "if k.startswith('HOROVOD_') and k != 'HOROVOD_DYNAMIC_PROCESS_SETS'}), flush=True)")


@pytest.mark.parametrize("compat", [None, "horovod", "kungfu"])
def test_sdprun_exports_horovods_worker_environment(compat):
    """Issue 31 item 4: horovodrun gives every worker HOROVOD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE,
    _CROSS_RANK, _CROSS_SIZE and HOROVOD_HOSTNAME; sdprun now does too, beside SDP_*, under any
    --compat and without it (before: none of them)."""
    seen = _json_per_rank(_sdprun(["-c", ENV_PROBE], compat=compat, hosts="localhost:2", timeout=120), "ENV")
    for r, got in seen.items():
        assert got == {"HOROVOD_RANK": str(r), "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": str(r),
                       "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
                       "HOROVOD_HOSTNAME": "localhost"}, got


HOROVOD_UTIL_NAMES = ["EXTENSIONS", "get_ext_suffix", "get_extension_full_path", "check_extension",
                      "extension_available", "gpu_available", "mpi_built", "gloo_built", "nccl_built", "ddl_built",
                      "ccl_built", "env", "get_average_backwards_compatibility_fun", "num_rank_is_power_2",
                      "split_list", "check_installed_version", "is_iterable", "is_version_greater_equal_than"]

MODULE_PROBE = r"""
import json, os
from horovod.common.util import is_version_greater_equal_than
from horovod.runner.common.util import env, hosts, settings
import horovod.common.util as cutil
out = {"missing": [n for n in json.loads(os.environ["NAMES"]) if not hasattr(cutil, n)],
       "rank_size": list(env.get_env_rank_and_size()),
       "versions": [is_version_greater_equal_than("2.16.1", "2.16.0"), is_version_greater_equal_than("2.9.0", "2.16.0")],
       "exportable": [env.is_exportable("PATH"), env.is_exportable("SDP_SECRET"), env.is_exportable("OLDPWD")],
       "slots": [s.to_response_string() for s in hosts.get_host_assignments(hosts.parse_hosts("a:2,b:1"), 3)],
       "settings": [settings.Settings(hosts="a:2", num_proc=2).hosts, settings.Settings().verbose],
       "modules": [env.__name__, hosts.__name__, settings.__name__, cutil.__name__]}
print("MOD " + json.dumps(out), flush=True)
"""


def test_horovod_module_paths_that_user_code_imports():
    """Issue 31 item 5: every public name of horovod.common.util (is_version_greater_equal_than
    was missing) and horovod.runner.common.util.{env,settings,hosts} (absent) resolve under
    sdprun --compat horovod, and env.get_env_rank_and_size() sees each rank's place."""
    seen = _json_per_rank(_sdprun(["-c", MODULE_PROBE], compat="horovod", timeout=120,
                                  NAMES=json.dumps(HOROVOD_UTIL_NAMES)), "MOD")
    for r, got in seen.items():
        assert got["missing"] == []
        assert got["rank_size"] == [r, 2]
        assert got["versions"] == [True, False]
        assert got["exportable"] == [True, False, False]
        assert got["slots"] == ["0,3,0,2,0,2", "1,3,1,2,0,1", "2,3,0,1,1,2"]
        assert got["settings"] == ["a:2", 0]
        assert got["modules"] == ["sdp.compat_horovod.runner.common.util.env",
                                  "sdp.compat_horovod.runner.common.util.hosts",
                                  "sdp.compat_horovod.runner.common.util.settings", "sdp.common.util"]


def test_version_helper_rejects_what_horovods_does():
    from sdp.common.util import is_version_greater_equal_than
    with pytest.raises(ValueError, match="two strings"):
        is_version_greater_equal_than(2, "1.0.0")
    with pytest.raises(ValueError, match="major.minor.patch"):
        is_version_greater_equal_than("2.16", "2.16")


def test_horovod_user_fidelity_test_file_runs_unmodified():
    """tests/horovod_user/test_tensorflow_hvd_fidelity.py (a tf.test.TestCase for items 1, 2, 4, 5,
    6: gradients in graph and eager modes, FailedPrecondition/InvalidArgument, HOROVOD_* and
    horovod.runner.common.util.env, the Keras callback on a lazily built model) passes on both
    ranks under sdprun --compat horovod -np 2 python -m pytest."""
    res = _sdprun(["-m", "pytest", "-p", "no:cacheprovider", "-q",
                   os.path.join("tests", "horovod_user", "test_tensorflow_hvd_fidelity.py")], compat="horovod")
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-3000:]
    found = _per_rank(res.stdout, r"^(\d+) passed")
    assert sorted(found) == [0, 1], res.stdout[-3000:]
    for m in found.values():
        assert int(m.group(1)) == 9 and "failed" not in m.string and "error" not in m.string, m.string


def test_horovod_keras_mnist_example_with_tf_keras(tmp_path):
    """Horovod's tensorflow2_keras_mnist.py pattern (Sequential built by its first batch, callbacks,
    fit, a checkpoint on rank 0) on real MNIST with TF_USE_LEGACY_KERAS=1 and tf_keras: both ranks
    end with the same weights and the averaged losses (before: "Weights for model 'sequential'
    have not yet been created" at train begin)."""
    pytest.importorskip("tf_keras")
    mnist = _mnist_dir()
    script = os.path.join(REPO, "tests", "horovod_user", "tensorflow2_keras_mnist.py")
    res = _sdprun([script], compat="horovod", cwd=str(tmp_path), TF_USE_LEGACY_KERAS="1", MNIST_DIR=mnist, EPOCHS="2",
                  STEPS="8")
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-3000:]
    found = _per_rank(res.stdout, r"KERAS_MNIST rank (\d) keras (\S+) loss (\S+) weights (\w+)")
    assert sorted(found) == [0, 1], res.stdout[-3000:]
    assert {m.group(2) for m in found.values()} == {"tf_keras"}
    assert found[0].group(3) == found[1].group(3) and found[0].group(4) == found[1].group(4)
    losses = [float(v) for v in found[0].group(3).split(",")]
    assert losses[-1] < losses[0]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1.h5", "checkpoint-2.h5"]


KUNGFU_PROBE = r"""
import json, os, gzip, shutil, tempfile
import numpy as np
from kungfu.tensorflow.v1.helpers.mnist import load_datasets
from kungfu.tensorflow.v1.helpers import idx, utils
from kungfu.tensorflow.v1.helpers.cifar import Cifar10Loader
from kungfu.tensorflow.v1.benchmarks import all_reduce_benchmark
import kungfu.tensorflow.v1.ops as v1ops
from kungfu.python import current_rank
d = os.environ["MNIST_DIR"]
raw = load_datasets(d)
m = load_datasets(d, normalize=True, one_hot=True)
p = load_datasets(d, padded=True)
out = {"raw": [list(raw.train.images.shape), str(raw.train.images.dtype), list(raw.train.labels.shape),
               raw.train.labels[:5].tolist(), list(raw.test.images.shape), int(raw.train.images.max())],
       "norm": [str(m.train.images.dtype), float(m.train.images.max()), list(m.train.labels.shape),
                float(m.train.labels.sum()), m.train.labels[:5].argmax(1).tolist()],
       "padded": [list(p.train.images.shape), int(p.train.images[:, :2].max())],
       "sizes": [utils.show_size(3 * 1024 ** 2), utils.show_size(100), utils.show_rate(2048, 1.0)]}
tmp = tempfile.mkdtemp()
a = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
idx.write_idx_file(os.path.join(tmp, "a.idx"), a)
back = idx.read_idx_file(os.path.join(tmp, "a.idx"))
with open(os.path.join(tmp, "a.idx"), "rb") as f:
    blob = f.read()
with open(os.path.join(tmp, "cut.idx"), "wb") as f:
    f.write(blob[:-4])
try:
    idx.read_idx_file(os.path.join(tmp, "cut.idx"))
    cut = "no error"
except ValueError as e:
    cut = str(e)
out["idx"] = [back.tolist() == a.tolist(), str(back.dtype), cut]
durations, reduced = all_reduce_benchmark([1000, 3000], warmup_steps=1, bench_steps=2)
out["bench"] = [len(durations), [float(r[0]) for r in reduced], [len(r) for r in reduced]]
out["v1ops"] = hasattr(v1ops, "group_all_reduce")
shutil.rmtree(tmp)
print("KF " + json.dumps(out), flush=True)
"""


def test_kungfu_tensorflow_v1_helpers_on_real_mnist():
    """Issue 31 item 8: kungfu.tensorflow.v1 (before: ModuleNotFoundError) under sdprun --compat
    kungfu: helpers.mnist.load_datasets on the real MNIST IDX files (as distributed, gzipped),
    normalize/one_hot/padded, helpers.idx round trip and a truncated file refused, helpers.utils,
    and the fake-data allreduce benchmark on sdp's engine."""
    mnist = _mnist_dir()
    found = _json_per_rank(_sdprun(["-c", KUNGFU_PROBE], compat="kungfu", MNIST_DIR=mnist), "KF")
    for got in found.values():
        assert got["raw"] == [[60000, 28, 28], "uint8", [60000], [5, 0, 4, 1, 9], [10000, 28, 28], 255]
        assert got["norm"] == ["float32", 1.0, [60000, 10], 60000.0, [5, 0, 4, 1, 9]]
        assert got["padded"] == [[60000, 32, 32, 1], 0]
        assert got["sizes"] == ["3.00Mi", "100", "2.00KiB/s"]
        assert got["idx"][:2] == [True, "int32"] and "needs" in got["idx"][2]
        assert got["bench"] == [2, [2.0, 2.0], [1000, 3000]]
        assert got["v1ops"] is True


KUNGFU_ADAPTOR = r"""
import json, os
import numpy as np
import tensorflow as tf
from kungfu.datasets.adaptor import BaseDatasetAdaptor
from kungfu.python import current_cluster_size, current_rank
from kungfu.tensorflow.optimizers import SynchronousSGDOptimizer
from kungfu.tensorflow.initializer import BroadcastGlobalVariablesOp
from kungfu.tensorflow.v1.helpers.mnist import load_datasets
tf.compat.v1.disable_eager_execution()
n = 2000
data = load_datasets(os.environ["MNIST_DIR"], normalize=True, one_hot=True)
ds = tf.data.Dataset.from_tensor_slices((np.arange(n), data.train.images[:n].reshape(n, 784),
                                         data.train.labels[:n]))
adapt = BaseDatasetAdaptor(batch_size=50, shard_count=current_cluster_size(), shard_id=current_rank())
init, (idx, x, y) = adapt(ds)
w = tf.compat.v1.Variable(tf.zeros([784, 10]))
loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=tf.matmul(x, w)))
train = SynchronousSGDOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5)).minimize(loss)
update, rewind = adapt.create_update_offset(), adapt.create_rewind()
out = {"steps": [], "losses": []}
with tf.compat.v1.Session() as sess:
    sess.run(tf.compat.v1.global_variables_initializer())
    sess.run(BroadcastGlobalVariablesOp())
    sess.run(init)
    for step in range(6):
        i, l, _ = sess.run([idx, loss, train])
        sess.run(update)
        out["steps"].append(i.tolist())
        out["losses"].append(float(l))
    sess.run(init)  # as after a resize: the iterator again, from the job's offset
    out["reinit"] = sess.run(idx).tolist()
    sess.run(rewind)
    sess.run(init)
    out["rewind"] = sess.run(idx).tolist()
    out["w"] = float(np.abs(sess.run(w)).sum())
    adapt.debug(sess)
print("KA " + json.dumps(out), flush=True)
"""


def test_kungfu_dataset_adaptor_shards_real_mnist_over_the_ranks():
    """Issue 31 item 8, the datasets adaptor: KungFu ships it as kungfu.datasets.adaptor (beside
    kungfu.tensorflow.v1.helpers); before: ModuleNotFoundError.  Two ranks of a TF1 Session on
    real MNIST with SynchronousSGDOptimizer: each step's batches of the two ranks are the next 100
    samples (rank r the r-th 50), the offset variable carries the position over a new iterator
    (as after a resize), rewind starts again at 0, both ranks train the same weights."""
    mnist = _mnist_dir()
    res = _sdprun(["-c", KUNGFU_ADAPTOR], compat="kungfu", MNIST_DIR=mnist)
    found = _json_per_rank(res, "KA")
    for r, got in found.items():
        for step, batch in enumerate(got["steps"]):
            assert batch == list(range(100 * step + 50 * r, 100 * step + 50 * r + 50)), (r, step, batch[:3])
        assert got["reinit"] == list(range(600 + 50 * r, 650 + 50 * r))
        assert got["rewind"] == list(range(50 * r, 50 * r + 50))
        assert got["losses"][-1] < got["losses"][0]
    assert found[0]["w"] == found[1]["w"] and found[0]["w"] > 0
    for r in range(2):
        assert f"[{r}]<stdout>:offset=0, np=2, rank={r}, batch size=50" in res.stdout  # after the rewind


def test_kungfu_example_dataset_adaptor_topology_update():
    """KungFu's ExampleDatasetAdaptor (its own cifar/imagenet examples' pattern, one process):
    update_topology adds a worker, 2 to the batch size and moves the shard id; the base class
    raises 'Not implemented'; bad shapes are refused with the values."""
    from sdp_kungfu_bridge.datasets.adaptor import BaseDatasetAdaptor, ExampleDatasetAdaptor
    import tensorflow as tf
    with tf.Graph().as_default():
        adapt = ExampleDatasetAdaptor(batch_size=10, shard_count=4)
        init, batch = adapt(tf.data.Dataset.from_tensor_slices(np.arange(1024)))
        offset, topology = adapt.create_update_offset(), adapt.create_update_topology()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(init)
            first = [sess.run(batch).tolist(), sess.run(batch).tolist()]
            sess.run(offset)
            sess.run(topology)
            sess.run(init)
            after = sess.run(batch).tolist()
        with pytest.raises(RuntimeError, match="Not implemented"):
            BaseDatasetAdaptor().create_update_topology()
        with pytest.raises(ValueError, match=r"shard_id must be in \[0, 2\), got 3"):
            BaseDatasetAdaptor(shard_count=2, shard_id=3)
        with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
            BaseDatasetAdaptor(batch_size=0)
    assert first == [list(range(0, 10)), list(range(40, 50))]  # shard 0 of 4: every 4th batch of 10
    assert after == list(range(40 + 12, 40 + 24))  # offset 40; 5 shards of 12, this one now id 1


def test_kungfu_model_sizes_are_measured_from_keras():
    from sdp_kungfu_bridge.tensorflow.v1.benchmarks import model_sizes
    sizes = model_sizes.resnet50_imagenet
    assert sum(sizes) == 25583592 and len(sizes) == 214  # Keras ResNet50: 25,583,592 trainable parameters
    with pytest.raises(AttributeError, match="bert"):
        model_sizes.bert


@pytest.mark.parametrize("leaver", [1, 0])
def test_stall_shutdown_reaches_a_rank_blocked_in_a_tf1_session(leaver, tmp_path):
    """Issue 31 item 7: one rank leaves a loop of TF1 Session.run collectives; the other, blocked
    inside Session.run, gets an error naming the tensor after HOROVOD_STALL_SHUTDOWN_TIME_SECONDS
    (Horovod's name of SDP_STALL_SHUTDOWN_TIME), whether the coordinator (rank 0) or another rank
    left; the rank that moved on gets StallError naming that tensor at its next collective.
    (This held on the code before: the test pins it.)"""
    flag = str(tmp_path / "failed")
    values = check_ok(run_workers(2, "workers_tf_fidelity:diverging_tf1_loop", [leaver, flag], timeout=120,
                                  env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1",
                                       "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3"}))
    blocked = values[1 - leaver]
    assert blocked["loop"][1:] == [True, True], blocked
    moved = values[leaver]
    assert moved["loop"] == "left"
    assert moved["after"][0] == "StallError" and "'loop_grad'" in moved["after"][1], moved
    assert f"missing ranks [{leaver}]" in moved["after"][1]
