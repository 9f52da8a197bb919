"""Drop-in import compatibility (sdp.compat, ``sdprun --compat``): real processes, small models."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import sdp.compat as compat
from sdp.launcher import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(*paths, **extra):
    env = dict(os.environ)
    for k in ("SDP_COMPAT", "SDP_COMPAT_FORCE", cli.ALLOW_FAKE_HOSTS_ENV):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([REPO, *paths] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    env.update(extra)
    return env


def _sdprun(*args, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "sdp.launcher.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env or _env(), cwd=REPO)


def _python(code, timeout=60, env=None):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env or _env(), cwd=REPO)


def _tagged(stdout, tag):
    """``{rank: payload}`` from worker lines ``[r]<stdout>:TAG payload``."""
    out = {}
    for line in stdout.splitlines():
        head, _, rest = line.partition("<stdout>:")
        if rest.startswith(tag + " "):
            out[int(head.strip("[]"))] = rest[len(tag) + 1:]
    return out


# ---------------------------------------------------------------- unmodified scripts under sdprun

TRAIN = """\
import json
import numpy as np
import tensorflow as tf
{import_line}

hvd.init()
tf.random.set_seed(1234 + hvd.rank())  # different initial weights until the broadcast
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3, activation="tanh"),
                             tf.keras.layers.Dense(1)])
opt = tf.keras.optimizers.Adam(0.01 * hvd.size())
rng = np.random.RandomState(hvd.rank())
x, y = rng.rand(8, 4).astype("float32"), rng.rand(8, 1).astype("float32")
for step in range(3):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if step == 0:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables(), root_rank=0)
weights = [float(v) for w in model.get_weights() for v in np.ravel(w)]
print("MODULE", hvd.__name__, hvd.size())
print("WEIGHTS", json.dumps(weights))
"""


@pytest.mark.tf
@pytest.mark.parametrize("family,import_line,module", [
    ("horovod", "import horovod.tensorflow as hvd", "sdp.compat_horovod.tensorflow"),
    ("smdistributed", "import smdistributed.dataparallel.tensorflow as hvd", "sdp.compat_smddp.tensorflow"),
])
def test_unmodified_script_runs_under_sdprun_compat(tmp_path, family, import_line, module):
    pytest.importorskip("tensorflow")
    if compat._real_guard(family) is not None:
        pytest.skip(f"a real {family} is installed here; the shim would (rightly) defer to it")
    script = tmp_path / "train.py"
    script.write_text(TRAIN.format(import_line=import_line))
    res = _sdprun("--compat", family, "-np", "2", sys.executable, str(script), timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    assert _tagged(res.stdout, "MODULE") == {0: f"{module} 2", 1: f"{module} 2"}
    weights = {r: np.array(json.loads(w)) for r, w in _tagged(res.stdout, "WEIGHTS").items()}
    assert sorted(weights) == [0, 1]
    np.testing.assert_allclose(weights[0], weights[1], rtol=1e-6, atol=1e-7)
    assert "real" not in res.stderr  # no shadowing warning when nothing real is installed


def test_compat_flag_accepts_lists_and_rejects_unknown():
    p = cli.build_parser()
    assert p.parse_args(["--compat", "kungfu,horovod", "true"]).compat == "horovod,kungfu"
    assert p.parse_args(["--compat", "all", "true"]).compat == "horovod,smdistributed,kungfu"
    with pytest.raises(SystemExit):
        p.parse_args(["--compat", "mpi4py", "true"])


def test_shims_follow_sdp_compat():
    code = ("import os, sys; import horovod, smdistributed.dataparallel; "
            "print('OK', os.environ['SDP_COMPAT'], horovod.__sdp_compat__, "
            "smdistributed.dataparallel.__sdp_compat__, callable(horovod.run))")
    res = _sdprun("--compat", "smdistributed,horovod", "-np", "1", sys.executable, "-c", code, timeout=30)
    assert res.returncode == 0, res.stderr
    assert "OK horovod,smdistributed horovod smdistributed True" in res.stdout
    # a family that --compat does not name stays unimportable (its shim says why)
    res = _sdprun("--compat", "kungfu", "-np", "1", sys.executable, "-c", "import horovod", timeout=30)
    assert res.returncode != 0
    assert "No module named 'horovod'" in res.stderr and "SDP_COMPAT" in res.stderr


# ---------------------------------------------------------------- in-process install()

@pytest.fixture
def installed_compat():
    yield
    compat.uninstall()


@pytest.mark.tf
def test_install_in_process_aliases_the_same_module(installed_compat):
    pytest.importorskip("tensorflow")
    for family in ("horovod", "smdistributed"):
        if compat._real_guard(family) is not None:
            pytest.skip(f"a real {family} is installed here")
    assert set(compat.install(["horovod", "smdistributed"])) == {"horovod", "smdistributed"}
    import horovod
    import horovod.tensorflow as hvd
    import smdistributed.dataparallel.tensorflow as smd

    import sdp.tensorflow
    import sdp.tensorflow.compression
    # smdistributed.dataparallel.tensorflow is sdp.tensorflow with SMDDP's init(); horovod.tensorflow
    # sdp.tensorflow with Horovod's process-set names: every other name is sdp's object
    assert smd.__spec__.name == "sdp.compat_smddp.tensorflow"  # the real module keeps its own spec
    assert smd.allreduce is sdp.tensorflow.allreduce and smd.init is not sdp.tensorflow.init
    assert hvd.__spec__.name == "sdp.compat_horovod.tensorflow"
    assert hvd.allreduce is sdp.tensorflow.allreduce and hvd.Compression is sdp.tensorflow.Compression
    assert hvd.AlreadyInitializedError is sdp.tensorflow.AlreadyInitializedError  # not in __all__
    assert hvd.init is sdp.tensorflow.init  # Horovod's rule is sdp's own
    from horovod.tensorflow.compression import Compression  # submodules follow their prefix
    assert Compression is sdp.tensorflow.compression.Compression
    assert horovod.run is compat.run
    with pytest.raises(ModuleNotFoundError):
        import horovod.mxnet  # noqa: F401  (not provided)
    keras = pytest.importorskip("keras")
    opt = keras.optimizers.SGD(0.1)
    assert isinstance(opt.variables, list) and opt.variables() == opt.variables
    compat.uninstall(["horovod", "smdistributed"])
    assert "horovod.tensorflow" not in sys.modules and compat.installed() == ()
    with pytest.raises(ModuleNotFoundError):
        import horovod  # noqa: F401,F811


def test_name_table():
    finder = compat._CompatFinder()
    for family in compat.FAMILIES:
        for alias, target in compat._FAMILY_DEFS[family].aliases:
            finder.aliases[alias] = (target, family)
        for alias, target in compat._FAMILY_DEFS[family].exact:
            finder.exact[alias] = (target, family)
    expected = {
        "horovod.tensorflow": "sdp.compat_horovod.tensorflow",
        "horovod.tensorflow.util": "sdp.tensorflow.util",
        "horovod.tensorflow.mpi_ops": "sdp.tensorflow.mpi_ops",
        "horovod.tensorflow.keras": "sdp.compat_horovod.keras",
        "horovod.tensorflow.keras.callbacks": "sdp.tensorflow.keras.callbacks",
        "horovod.keras": "sdp.compat_horovod.keras",
        "horovod.keras.callbacks": "sdp.tensorflow.keras.callbacks",
        "horovod.common.util": "sdp.common.util",
        "horovod.common.exceptions": "sdp.common.errors",
        "horovod.runner": "sdp.compat_horovod.runner",
        "horovod.runner.util.threads": "sdp.compat_horovod.runner.util.threads",
        "horovod.torch": "sdp.torch",
        "horovod.torch.mpi_ops": "sdp.torch.mpi_ops",
        "horovod.torch.elastic.sampler": "sdp.torch.elastic.sampler",
        "smdistributed.dataparallel.tensorflow": "sdp.compat_smddp.tensorflow",
        "smdistributed.dataparallel.tensorflow.keras": "sdp.compat_smddp.keras",
        "smdistributed.dataparallel.tensorflow.elastic": "sdp.tensorflow.elastic",
        "kungfu.python": "sdp_kungfu_bridge.python",
        "kungfu.tensorflow": "sdp_kungfu_bridge.tensorflow",
        "kungfu.tensorflow.ops": "sdp_kungfu_bridge.tensorflow.ops",
        "kungfu.tensorflow.optimizers": "sdp_kungfu_bridge.tensorflow.optimizers",
        "kungfu.tensorflow.initializer": "sdp_kungfu_bridge.tensorflow.initializer",
    }
    assert {name: finder.map(name)[0] for name in expected} == expected
    assert finder.map("horovod.torchx") is None and finder.map("horovod.tensorflowx") is None


def test_missing_target_names_what_is_missing():
    res = _python("""
        import sdp.compat
        sdp.compat.install("kungfu")
        try:
            import kungfu.tensorflow.no_such_module
        except ModuleNotFoundError as e:
            print("ERROR", e)
        """)
    assert res.returncode == 0, res.stderr
    # names the alias that failed (the submodule, or kungfu.tensorflow while the bridge lacks it)
    # and the sdp module that is missing
    assert "ERROR No module named 'kungfu.tensorflow" in res.stdout
    assert "sdp's kungfu compatibility maps it to 'sdp_kungfu_bridge.tensorflow" in res.stdout
    assert "does not exist" in res.stdout


# ---------------------------------------------------------------- never shadow a real install

@pytest.fixture
def fake_real_horovod(tmp_path):
    root = tmp_path / "site"
    (root / "horovod").mkdir(parents=True)
    (root / "horovod" / "__init__.py").write_text("REAL = True\n")
    return str(root)


CHECK = "import horovod; print('HOROVOD', getattr(horovod, 'REAL', False), getattr(horovod, '__sdp_compat__', None))"


def test_real_install_is_not_shadowed_by_install(fake_real_horovod):
    code = "import sdp.compat; print('ACTIVE', sdp.compat.install('horovod')); " + CHECK
    res = _python(code, env=_env(fake_real_horovod))
    assert res.returncode == 0, res.stderr
    assert "ACTIVE ()" in res.stdout and "HOROVOD True None" in res.stdout
    assert "real 'horovod' installation was found at" in res.stderr
    assert os.path.join(fake_real_horovod, "horovod") in res.stderr
    assert "NOT replacing" in res.stderr and "SDP_COMPAT_FORCE=1" in res.stderr

    for how, env in (("install(force=True)", _env(fake_real_horovod)),
                     ("SDP_COMPAT_FORCE", _env(fake_real_horovod, SDP_COMPAT_FORCE="1"))):
        force = "force=True" if how.startswith("install") else ""
        code = f"import sdp.compat; print('ACTIVE', sdp.compat.install('horovod', {force})); " + CHECK
        res = _python(code, env=env)
        assert res.returncode == 0, res.stderr
        assert "ACTIVE ('horovod',)" in res.stdout and "HOROVOD False horovod" in res.stdout, how
        assert "being replaced by sdp" in res.stderr, how


def test_real_install_is_not_shadowed_under_sdprun(fake_real_horovod):
    res = _sdprun("--compat", "horovod", "-np", "1", sys.executable, "-c", CHECK,
                  env=_env(fake_real_horovod), timeout=30)
    assert res.returncode == 0, res.stderr
    assert "HOROVOD True None" in res.stdout
    assert "real 'horovod' installation was found at" in res.stderr and "NOT replacing" in res.stderr

    res = _sdprun("--compat", "horovod", "-np", "1", sys.executable, "-c", CHECK,
                  env=_env(fake_real_horovod, SDP_COMPAT_FORCE="1"), timeout=30)
    assert res.returncode == 0, res.stderr
    assert "HOROVOD False horovod" in res.stdout and "being replaced by sdp" in res.stderr


# ---------------------------------------------------------------- kungfu

def test_kungfu_python_resolves_to_the_bridge():
    if importlib.util.find_spec("sdp_kungfu_bridge.python") is None:
        pytest.skip("sdp_kungfu_bridge.python does not exist yet (the KungFu bridge is being written)")
    code = ("import kungfu, kungfu.python, sdp_kungfu_bridge.python as b; "
            "print('SAME', kungfu.python is b, kungfu.__sdp_compat__)")
    res = _sdprun("--compat", "kungfu", "-np", "1", sys.executable, "-c", code, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "SAME True kungfu" in res.stdout


# ---------------------------------------------------------------- horovod.run

RUN_SCRIPT = """\
import sys
import sdp.compat
sdp.compat.install("horovod")
import horovod


def work(base, fail_rank=-1):
    import numpy as np
    import sdp
    sdp.init()
    if sdp.rank() == fail_rank:
        raise ValueError("boom on purpose")
    total = sdp.allreduce(np.array([float(sdp.rank() + base)]), op=sdp.Sum)
    return sdp.rank(), sdp.size(), float(total[0])


if __name__ == "__main__":
    if sys.argv[1:] == ["fail"]:
        try:
            horovod.run(work, args=(10,), kwargs={"fail_rank": 1}, np=2)
        except RuntimeError as e:
            print("FAILED", str(e).splitlines()[0])
    else:
        print("RESULTS", horovod.run(work, args=(10,), np=2))
"""


def test_horovod_run_starts_ranks_and_returns_results(tmp_path):
    if compat._real_guard("horovod") is not None:
        pytest.skip("a real horovod is installed here")
    script = tmp_path / "hrun.py"
    script.write_text(RUN_SCRIPT)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                         env=_env(), cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "RESULTS [(0, 2, 21.0), (1, 2, 21.0)]" in res.stdout
    res = subprocess.run([sys.executable, str(script), "fail"], capture_output=True, text=True,
                         timeout=60, env=_env(), cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "FAILED horovod.run: rank 1 failed: ValueError: boom on purpose" in res.stdout
