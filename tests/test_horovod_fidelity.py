"""Horovod's semantics under Horovod's names (issue 19): init() twice, Horovod's module paths,
Compression.fp16's contract, and a Horovod user's TensorFlow test file run unmodified under
``sdprun --compat horovod -np 2 python -m pytest``.  Real processes, no mocks."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

import sdp.compat as compat
from sdp.common import util as common_util
from sdp.compat_horovod.runner.util import threads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_FILE = os.path.join("tests", "horovod_user", "test_tensorflow_hvd.py")


def _env(**extra):
    env = dict(os.environ)
    for k in ("SDP_COMPAT", "SDP_COMPAT_FORCE", "SDP_FP16_SKIP_LOCAL"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    env.update(extra)
    return env


def _sdprun(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "sdp.launcher.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=REPO)


def _skip_if_real(family="horovod"):
    if compat._real_guard(family) is not None:
        pytest.skip(f"a real {family} is installed here; the shim would (rightly) defer to it")


# ---------------------------------------------------------------- one job: init() and module paths

PROBE = r"""
import json, os, sys
import numpy as np
out = {}

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import smdistributed.dataparallel.tensorflow as smd
import smdistributed.dataparallel.tensorflow.keras as smd_keras
import sdp.tensorflow

def init_outcome(init):
    try:
        init()
        return "ok"
    except Exception as e:
        return type(e).__name__

hvd.init()
out["init"] = [init_outcome(hvd.init), init_outcome(hvd_keras.init), init_outcome(smd.init),
               init_outcome(smd_keras.init), init_outcome(sdp.tensorflow.init)]
out["still_initialized"] = [hvd.is_initialized(), hvd.size(), hvd.rank() < hvd.size()]
hvd.shutdown()
out["after_shutdown"] = [hvd.is_initialized(), init_outcome(hvd.init), hvd.is_initialized()]

import horovod.tensorflow.util as util
import horovod.tensorflow.mpi_ops as mpi_ops
import horovod.tensorflow.functions as functions
import horovod.tensorflow.compression as compression
import horovod.tensorflow.elastic as elastic
import horovod.tensorflow.keras.callbacks as callbacks
import horovod.tensorflow.keras.elastic as keras_elastic
import horovod.keras as legacy_keras
import horovod.common.exceptions as exceptions
import horovod.common.util as cutil
import horovod.runner
import horovod.runner.util.threads as rthreads
from horovod.runner import run
from horovod.tensorflow.util import _executing_eagerly, _make_subgraph, _cache, vars_to_refs, refs_to_vars
from horovod.tensorflow.mpi_ops import (_allreduce, _grouped_allreduce, _normalize_name, _reducescatter,
    allgather, broadcast, handle_average_backwards_compatibility, size, rank, Average, Sum, Adasum, Min, Max,
    Product, size_op, rank_op, local_rank_op, local_size_op, process_set_included_op, join, init,
    check_num_rank_power_of_2, global_process_set, ProcessSet, add_process_set, remove_process_set)
from horovod.tensorflow.functions import broadcast_object, allgather_object, broadcast_variables
from horovod.tensorflow.compression import Compression, FP16Compressor, NoneCompressor
from horovod.tensorflow.keras.callbacks import BroadcastGlobalVariablesCallback, MetricAverageCallback
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from horovod.common.util import env, split_list, check_extension, is_iterable, gloo_built, mpi_built
from horovod.runner.util.threads import in_thread, execute_function_multithreaded, on_event

import tensorflow as tf
import sdp.common.errors, sdp.tensorflow.keras
out["modules"] = {m.__name__: m.__spec__.name for m in (hvd, hvd_keras, util, mpi_ops, functions, compression,
                  elastic, callbacks, keras_elastic, legacy_keras, exceptions, cutil, horovod.runner, rthreads)}
out["same_objects"] = [hvd.allreduce is sdp.tensorflow.allreduce, hvd_keras.callbacks is callbacks,
                       legacy_keras is hvd_keras, hvd.elastic is elastic, hvd_keras.elastic is keras_elastic, hvd.init is init, hvd_keras.init is init,
                       smd.allreduce is sdp.tensorflow.allreduce, Compression is sdp.tensorflow.Compression,
                       issubclass(sdp.common.errors.PeerLostError, HorovodInternalError),
                       hvd_keras.DistributedOptimizer is sdp.tensorflow.keras.DistributedOptimizer]
out["run_is_horovod_run"] = run.__module__

hvd.init()
x = tf.constant([1.0, 2.0])
out["low_level"] = [float(_allreduce(x).numpy().sum()), float(_allreduce(x, op=Average).numpy().sum()),
                    int(handle_average_backwards_compatibility(None, None)),
                    int(handle_average_backwards_compatibility(None, False)), _normalize_name("a/b:0"),
                    int(rank_op().numpy()), int(size_op().numpy()), _executing_eagerly()]
out["objects"] = [broadcast_object({"r": hvd.rank()}, root_rank=0), allgather_object(hvd.rank())]

out["elastic"] = [callable(elastic.run(lambda state: None)), keras_elastic.KerasState is elastic.TensorFlowKerasState,
                  elastic.HorovodInternalError is HorovodInternalError, keras_elastic.run is elastic.run,
                  [c.__name__ for c in (keras_elastic.CommitStateCallback, keras_elastic.UpdateBatchStateCallback,
                                        keras_elastic.UpdateEpochStateCallback)]]
try:
    add_process_set([0])
    no_dynamic = "no error"
except ValueError as e:
    no_dynamic = str(e)
out["process_sets"] = [no_dynamic, hvd.ProcessSet([1, 0]).ranks, global_process_set.ranks,
                       global_process_set is hvd.global_process_set is hvd_keras.global_process_set,
                       hvd.ProcessSet is ProcessSet, int(process_set_included_op().numpy())]
print("PROBE " + json.dumps(out), flush=True)
"""


@pytest.mark.tf
def test_init_semantics_and_module_paths_under_sdprun_compat(tmp_path):
    """Under horovod.* and plain sdp.tensorflow init() again is a no-op; under smdistributed.*
    it raises; every Horovod module path imports and maps to a real sdp module."""
    pytest.importorskip("tensorflow")
    _skip_if_real("horovod")
    _skip_if_real("smdistributed")
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    res = _sdprun("--compat", "horovod,smdistributed", "-np", "2", sys.executable, str(script))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    probes = {}
    for line in res.stdout.splitlines():
        head, _, rest = line.partition("<stdout>:")
        if rest.startswith("PROBE "):
            probes[int(head.strip("[]"))] = json.loads(rest[len("PROBE "):])
    assert sorted(probes) == [0, 1], res.stdout[-3000:]
    for r, out in probes.items():
        assert out["init"] == ["ok", "ok", "AlreadyInitializedError", "AlreadyInitializedError", "ok"]
        assert out["still_initialized"] == [True, 2, True]
        assert out["after_shutdown"] == [False, "ok", True]
        assert out["modules"] == {
            "sdp.compat_horovod.tensorflow": "sdp.compat_horovod.tensorflow",
            "sdp.compat_horovod.keras": "sdp.compat_horovod.keras",
            "sdp.tensorflow.util": "sdp.tensorflow.util",
            "sdp.tensorflow.mpi_ops": "sdp.tensorflow.mpi_ops",
            "sdp.tensorflow.functions": "sdp.tensorflow.functions",
            "sdp.tensorflow.compression": "sdp.tensorflow.compression",
            "sdp.tensorflow.elastic": "sdp.tensorflow.elastic",
            "sdp.tensorflow.keras.callbacks": "sdp.tensorflow.keras.callbacks",
            "sdp.tensorflow.keras.elastic": "sdp.tensorflow.keras.elastic",
            "sdp.common.errors": "sdp.common.errors",
            "sdp.common.util": "sdp.common.util",
            "sdp.compat_horovod.runner": "sdp.compat_horovod.runner",
            "sdp.compat_horovod.runner.util.threads": "sdp.compat_horovod.runner.util.threads",
        }
        assert out["same_objects"] == [True] * 11
        assert out["run_is_horovod_run"] == "sdp.compat_horovod.runner"
        # _allreduce defaults to Sum (Horovod's low-level op); the top-level default is Average
        assert out["low_level"] == [6.0, 3.0, 0, 1, "a_b_0", r, 2, True]
        assert out["objects"] == [{"r": 0}, [0, 1]]
        assert out["elastic"] == [True, True, True, True, ["CommitStateCallback", "UpdateBatchStateCallback",
                                                           "UpdateEpochStateCallback"]]
        assert out["process_sets"] == ["Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets after "
                                       "Horovod initialization.", [0, 1], [0, 1], True, True, 1]


# ---------------------------------------------------------------- a Horovod user's test file

@pytest.mark.tf
def test_horovod_user_test_file_runs_unmodified():
    """tests/horovod_user/test_tensorflow_hvd.py (hvd.init() in every test, graph and eager modes
    via run_in_graph_and_eager_modes, horovod.tensorflow.util / horovod.runner.util.threads
    imports) passes on both ranks."""
    pytest.importorskip("tensorflow")
    _skip_if_real("horovod")
    res = _sdprun("--compat", "horovod", "-np", "2", sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                  "-q", USER_FILE, timeout=240)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-3000:]
    summaries = {}
    for line in res.stdout.splitlines():
        head, _, rest = line.partition("<stdout>:")
        m = re.match(r"(\d+) passed", rest.strip())
        if m:
            summaries[int(head.strip("[]"))] = (int(m.group(1)), rest)
    assert sorted(summaries) == [0, 1], res.stdout[-3000:]
    for rank, (passed, line) in summaries.items():
        assert passed == 15 and "failed" not in line and "error" not in line, line


def test_horovod_user_tests_are_not_collected_by_the_normal_suite():
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          os.path.join("tests", "horovod_user")], capture_output=True, text=True, timeout=120,
                         env=_env(), cwd=REPO)
    assert "test_tensorflow_hvd" not in res.stdout, res.stdout
    assert "no tests collected" in res.stdout or res.returncode == 5, res.stdout + res.stderr


# ---------------------------------------------------------------- Compression.fp16 (Horovod's list)

FLOATING = ["float16", "bfloat16", "float32", "float64"]
OTHERS = ["uint8", "int8", "uint16", "int16", "int32", "int64", "bool"]


@pytest.mark.tf
@pytest.mark.parametrize("dtype_name", FLOATING + OTHERS)
def test_compression_fp16_dtypes(dtype_name):
    """Horovod's contract: floating inputs travel as float16 and come back in their own dtype;
    the others pass unchanged (same tensor)."""
    tf = pytest.importorskip("tensorflow")
    from sdp.tensorflow.compression import Compression
    dtype = tf.as_dtype(dtype_name)
    tensor = tf.ones([17] * 3, dtype=dtype)
    compressed, ctx = Compression.fp16.compress(tensor)
    if dtype_name in FLOATING:
        assert compressed.dtype == tf.float16
    else:
        assert compressed is tensor
    restored = Compression.fp16.decompress(compressed, ctx)
    assert restored.dtype == dtype
    np.testing.assert_array_equal(np.asarray(restored.numpy(), dtype=np.float64), np.ones([17] * 3))
    none, none_ctx = Compression.none.compress(tensor)
    assert none is tensor and Compression.none.decompress(none, none_ctx) is tensor


@pytest.mark.tf
def test_compression_fp16_in_a_graph():
    tf = pytest.importorskip("tensorflow")
    from sdp.tensorflow.compression import Compression

    @tf.function
    def roundtrip(x):
        c, ctx = Compression.fp16.compress(x)
        return c, Compression.fp16.decompress(c, ctx)

    c, back = roundtrip(tf.constant([1.5, 2.25], tf.float64))
    assert c.dtype == tf.float16 and back.dtype == tf.float64
    np.testing.assert_array_equal(back.numpy(), [1.5, 2.25])


@pytest.mark.tf
def test_gradient_reducers_skip_the_cast_only_while_switched_on(monkeypatch):
    """The skip lives where gradient collectives are issued (tape, optimizers) and
    SDP_FP16_SKIP_LOCAL=0 turns it off."""
    pytest.importorskip("tensorflow")
    from sdp.tensorflow.compression import (Compression, FP16Compressor, NoneCompressor, WireFP16Compressor,
                                            gradient_compression)
    monkeypatch.delenv("SDP_FP16_SKIP_LOCAL", raising=False)
    assert gradient_compression(Compression.fp16) is WireFP16Compressor
    assert gradient_compression(Compression.none) is NoneCompressor
    assert gradient_compression(None) is NoneCompressor
    for off in ("0", "false", "off"):
        monkeypatch.setenv("SDP_FP16_SKIP_LOCAL", off)
        assert gradient_compression(Compression.fp16) is FP16Compressor
    monkeypatch.setenv("SDP_FP16_SKIP_LOCAL", "1")
    assert gradient_compression(Compression.fp16) is WireFP16Compressor


# ---------------------------------------------------------------- helpers with Horovod's names

@pytest.mark.tf
def test_tensorflow_util_helpers():
    tf = pytest.importorskip("tensorflow")
    from sdp.tensorflow import util
    calls = []

    @util._cache
    def build(n):
        calls.append(n)
        return n * 2

    assert [build(1), build(1), build(2)] == [2, 2, 4] and calls == [1, 2]
    graph_mode = tf.function(lambda: tf.constant(util._executing_eagerly()))
    assert util._executing_eagerly() and not bool(graph_mode().numpy())
    assert float(util._make_subgraph(lambda x: x * 2)(tf.constant(3.0)).numpy()) == 6.0
    a, b = tf.Variable(1.0), tf.Variable(2.0)
    refs = util.vars_to_refs([a, [b]])
    assert isinstance(refs, tuple) and {refs: 1}[refs] == 1  # hashable
    back = util.refs_to_vars(refs)
    assert back[0] is a and back[1][0] is b


def test_common_util_helpers(monkeypatch):
    assert common_util.split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert common_util.split_list([1], 2) == [[1], []]
    monkeypatch.setenv("SDP_TEST_KEEP", "old")
    monkeypatch.delenv("SDP_TEST_NEW", raising=False)
    with common_util.env(SDP_TEST_KEEP="new", SDP_TEST_NEW="x", SDP_TEST_NONE=None):
        assert os.environ["SDP_TEST_KEEP"] == "new" and os.environ["SDP_TEST_NEW"] == "x"
        assert "SDP_TEST_NONE" not in os.environ
    assert os.environ["SDP_TEST_KEEP"] == "old" and "SDP_TEST_NEW" not in os.environ
    assert [common_util.num_rank_is_power_2(n) for n in (0, 1, 2, 3, 4, 6, 8)] == [False, True, True, False,
                                                                                   True, False, True]
    assert common_util.is_iterable([]) and not common_util.is_iterable(3)
    assert common_util.mpi_built() is False and common_util.nccl_built() == 0
    with pytest.raises(ImportError, match="horovod.mxnet"):
        common_util.check_extension("horovod.mxnet", "HOROVOD_WITH_MXNET", __file__, "mpi_lib")
    has_torch = importlib.util.find_spec("torch") is not None
    assert common_util.extension_available("horovod.torch") is has_torch  # (the PyTorch face, sdp.torch)
    fun = common_util.get_average_backwards_compatibility_fun(compat_ops())
    assert fun(None, None) == "avg" and fun("max", None) == "max"
    with pytest.warns(DeprecationWarning):
        assert fun(None, False) == "sum"
    with pytest.raises(ValueError, match="supersedes"):
        fun("max", True)


def compat_ops():
    class Ops:
        Average, Sum = "avg", "sum"
    return Ops


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the 1 // 0 on purpose
def test_runner_threads():
    results = threads.execute_function_multithreaded(lambda a, b: a * b, [[1, 2], [3, 4], [5, 6]],
                                                     max_concurrent_executions=2)
    assert results == {0: 2, 1: 12, 2: 30}
    with pytest.raises(RuntimeError, match="did not complete"):
        threads.execute_function_multithreaded(lambda a: 1 // a, [[1], [0]])
    with pytest.raises(ValueError, match="tuple"):
        threads.in_thread(print, args=[1])
    box = []
    threads.in_thread(box.append, args=(7,)).join(5)
    assert box == [7]
    threads.in_thread(lambda: 1 // 0, silent=True).join(5)  # swallowed
    event, stop, fired = threading.Event(), threading.Event(), []
    t = threads.on_event(event, fired.append, args=("go",), stop=stop, check_stop_interval_s=0.01)
    event.set()
    t.join(5)
    assert fired == ["go"]
    event2, stop2, fired2 = threading.Event(), threading.Event(), []
    t2 = threads.on_event(event2, fired2.append, args=("no",), stop=stop2, check_stop_interval_s=0.01)
    stop2.set()
    t2.join(5)
    assert not t2.is_alive() and fired2 == []
    with pytest.raises(ValueError, match="Stop event"):
        threads.on_event(threading.Event(), print, daemon=False)


def test_horovod_exceptions():
    from sdp.common import errors
    assert errors.HorovodInternalError is errors.SdpError
    assert issubclass(errors.StallError, errors.HorovodInternalError)
    e = errors.HostsUpdatedInterrupt(skip_sync=True)
    assert e.skip_sync is True and isinstance(e, RuntimeError)
    v = errors.HorovodVersionMismatchError("tensorflow", "2.16", "2.15")
    assert isinstance(v, ImportError) and "2.15" in str(v) and v.installed_version == "2.15"


def test_name_table_has_every_horovod_path():
    finder = compat._CompatFinder()
    d = compat._FAMILY_DEFS["horovod"]
    for alias, target in d.aliases:
        finder.aliases[alias] = (target, "horovod")
    for alias, target in d.exact:
        finder.exact[alias] = (target, "horovod")
    paths = ["horovod.tensorflow.util", "horovod.tensorflow.mpi_ops", "horovod.tensorflow.functions",
             "horovod.tensorflow.compression", "horovod.tensorflow.elastic", "horovod.common.exceptions",
             "horovod.common.util", "horovod.runner", "horovod.runner.util", "horovod.runner.util.threads",
             "horovod.tensorflow.keras.callbacks", "horovod.tensorflow.keras.elastic", "horovod.keras.elastic"]
    import importlib.util
    for path in paths:
        target = finder.map(path)[0]
        assert importlib.util.find_spec(target) is not None, (path, target)

