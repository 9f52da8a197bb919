"""KungFu's MindSpore face (sdp_kungfu_bridge.mindspore) in real MindSpore processes.

Needs MindSpore (``pip install -e ".[mindspore,test]"`` in a numpy<2 virtual environment: .ci/run
makes one); skipped with the reason without it.  Workers: tests/workers_kungfu_mindspore.py."""
import os
import re
import subprocess
import sys
import textwrap

import pytest

try:
    import mindspore  # noqa: F401
    _MS = None
except Exception as e:  # ImportError, or numpy 2 ("Numpy init failed")
    _MS = f"{type(e).__name__}: {e}"

pytestmark = pytest.mark.skipif(_MS is not None, reason=f"mindspore not usable here ({_MS}); "
                                "install the 'mindspore' extra in a numpy<2 venv (see .ci/run)")

from harness import check_ok, run_workers  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "mindspore_lenet_elastic.py")
ENV = {"GLOG_v": "3", "PYTHONWARNINGS": "ignore"}  # MindSpore's warnings off


def _sdprun(*args, timeout=300, cwd=REPO):
    env = dict(os.environ, **ENV)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "sdp.launcher.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_ops_against_numpy(n):
    modes = ["graph", "pynative"] if n == 2 else ["graph"]
    for mode in modes:
        out = check_ok(run_workers(n, "workers_kungfu_mindspore:ops_vs_numpy", [mode], env=ENV, init=False,
                                   timeout=240))
        for r, o in enumerate(out):
            assert o["bad"] == [], (mode, r, o["bad"])
            assert (o["rank"], o["size"], o["op_size"], o["using"]) == (r, n, n, True)


def test_pynative_optimizer_allreduces_once():
    """MindSpore 2.10 PYNATIVE: a subclass construct calling super().construct() of the @jit
    Momentum is compiled and run again by the parent's jit (gradients summed twice).  The face's
    optimizers and the guide's hand-written subclass (the ops skip the compiled re-run) update
    once, with one allreduce request per gradient (one grouped request for the grouped class).
    Before: the guide's class made 4 requests for its 2 gradients and stepped by 2 * 3."""
    # weight 1 - lr * (sum over ranks of 1 + rank) = 1 - 0.1 * 3
    for cls in ("KungFuMomentum", "KungFuGroupedMomentum", "KungFuSGD", "guide"):
        for mode in ("pynative", "graph"):
            out = check_ok(run_workers(2, "workers_kungfu_mindspore:optimizer_step", [cls, mode], env=ENV,
                                       init=False, timeout=240))
            want = {"allreduce": 0, "grouped_allreduce": 1} if "Grouped" in cls else \
                {"allreduce": 2, "grouped_allreduce": 0}
            for o in out:
                assert o["weights"] == pytest.approx([0.7] * 3), (cls, mode, o)
                assert o["calls"] == want, (cls, mode, o)


def test_pynative_sync_keeps_parameters_trainable():
    """MindSpore 2.10 PYNATIVE: param.set_data() after the optimizer compiled freezes the
    parameter; the face's sync_net_parameters writes in place: synced, then trained on."""
    for mode in ("pynative", "graph"):
        out = check_ok(run_workers(2, "workers_kungfu_mindspore:sync_then_train", ["face", mode], env=ENV,
                                   init=False, timeout=240))
        assert out[0]["synced"] == out[1]["synced"]
        for o in out:
            assert o["trained"] != pytest.approx(o["synced"]), mode
    guide = check_ok(run_workers(2, "workers_kungfu_mindspore:sync_then_train", ["guide", "pynative"], env=ENV,
                                 init=False, timeout=240))
    assert guide[0]["synced"] == guide[1]["synced"]
    assert guide[0]["trained"] == guide[0]["synced"]  # the bug: frozen


_NAMES = textwrap.dedent("""
    import mindspore
    import mindspore._c_expression as c
    try:
        import mindspore.ops.operations.kungfu_comm_ops as kfops
        from mindspore.nn.optim.kungfu import KungFuMomentum
        from mindspore.train.callback._kungfu import KungFuElasticCallback
        print("names:", kfops.__name__, KungFuMomentum.__module__, KungFuElasticCallback.__module__,
              c.kungfu_current_rank(), c.kungfu_current_cluster_size(), flush=True)
    except ModuleNotFoundError as e:
        print("missing:", e.name, hasattr(c, "kungfu_init"), flush=True)
""")


def test_fork_names_only_under_compat(tmp_path):
    script = tmp_path / "names.py"
    script.write_text(_NAMES)
    res = _sdprun("--compat", "kungfu", "-np", "2", sys.executable, str(script))
    assert res.returncode == 0, res.stderr[-3000:]
    for r in range(2):
        assert (f"[{r}]<stdout>:names: sdp_kungfu_bridge.mindspore.ops sdp_kungfu_bridge.mindspore.optim "
                f"sdp_kungfu_bridge.mindspore.callback {r} 2") in res.stdout, res.stdout
    res = _sdprun("-np", "1", sys.executable, str(script))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "missing: mindspore.ops.operations.kungfu_comm_ops False" in res.stdout, res.stdout
    res = _sdprun("--compat", "horovod", "-np", "1", sys.executable, str(script))  # the shim, not enabled
    assert "missing: mindspore.ops.operations.kungfu_comm_ops False" in res.stdout, res.stdout + res.stderr


def test_kungfu_built_mindspore_is_left_alone(tmp_path):
    """A MindSpore that has its own kungfu_comm_ops (the fork) is used, with a warning."""
    fork = tmp_path / "fork"
    fork.mkdir()
    (fork / "kungfu_comm_ops.py").write_text("FORK = True\n")
    script = tmp_path / "fork_names.py"
    script.write_text(textwrap.dedent(f"""
        import warnings
        warnings.simplefilter("always")
        import mindspore.ops.operations as operations
        operations.__path__.append({str(fork)!r})  # as if the fork's file were installed there
        import mindspore.ops.operations.kungfu_comm_ops as kfops
        print("fork:", getattr(kfops, "FORK", False), flush=True)
    """))
    res = _sdprun("--compat", "kungfu", "-np", "1", sys.executable, str(script))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "fork: True" in res.stdout
    assert "CompatShadowWarning" in res.stderr and "KungFu-built MindSpore" in res.stderr


def _checksums(stdout):
    return re.findall(r"^\[(\d+)\]<stdout>:parameters checksum: ([0-9a-f]+)$", stdout, re.M)


@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_example_ranks_agree(mode):
    steps = 30 if mode == "graph" else 10  # PYNATIVE runs op by op: ~4x slower here
    res = _sdprun("--compat", "kungfu", "-np", "2", sys.executable, EXAMPLE, "--schedule", "", "--max-step",
                  str(steps), "--mode", mode, "--test-samples", "500")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    sums = _checksums(res.stdout)
    assert sorted(r for r, _ in sums) == ["0", "1"] and len({c for _, c in sums}) == 1, res.stdout
    assert "[0]<stdout>:test accuracy: " in res.stdout
    for r in range(2):
        assert f"[{r}]<stdout>:steps run: {steps} (global steps 1..{steps})" in res.stdout


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_guide_launch_line_elastic_schedule(tmp_path):
    """The guide's kungfu-run flags; the callback's schedule grows, shrinks and grows the job."""
    port = _free_port()
    res = _sdprun("--compat", "kungfu", "-q", "-logdir", str(tmp_path / "logs"), "-np", "1", "-w",
                  "-builtin-config-port", str(port), "-config-server", f"http://127.0.0.1:{port}/config",
                  sys.executable, EXAMPLE, "--schedule", "3:2,6:1,9:2", "--max-step", "12", "--test-samples", "200")
    out = res.stdout
    assert res.returncode == 0, out[-3000:] + res.stderr[-3000:]
    assert "PeerLostError" not in out + res.stderr
    # who ran which global steps: rank 0 all, a joiner 4..6 (detached at 6), another 10..12
    assert "[0]<stdout>:steps run: 12 (global steps 1..12)" in out
    assert "[1]<stdout>:sync step 1 -> 4" in out and "[1]<stdout>:sync step 1 -> 10" in out
    assert "[1]<stdout>:detached at step 6 after 3 steps" in out
    assert "[1]<stdout>:steps run: 3 (global steps 10..12)" in out
    # the data position (samples trained by the cluster, 32 per worker and step) is synced too: a
    # joiner starts at the others' sample, not at its own shard's start; 3*32 + 3*64 + 3*32 + 3*64
    for joined_at in (96, 384):
        assert f"[0]<stdout>:sync data position {joined_at} -> {joined_at}" in out, out[-3000:]
        assert f"[1]<stdout>:sync data position 0 -> {joined_at}" in out, out[-3000:]
        assert f"[1]<stdout>:data from sample {joined_at}: rank 1 of 2" in out
    assert "[0]<stdout>:data position: 576" in out and "[1]<stdout>:data position: 576" in out
    logs = tmp_path / "logs"  # -logdir: one pair of files per worker started (rank 1 twice)
    assert "sync step 1 -> 4" in (logs / "worker1.rank1.stdout.log").read_text()
    assert "sync step 1 -> 10" in (logs / "worker2.rank1.stdout.log").read_text()
    # 1..3 by one worker, 4..6 by two, 7..9 by one, 10..12 by two: every step once per worker
    sums = _checksums(out)
    assert sorted(r for r, _ in sums) == ["0", "1"] and len({c for _, c in sums}) == 1, out


_STREAM = textwrap.dedent("""
    import sys
    import numpy as np
    import sdp_kungfu_bridge.mindspore as face
    assert face.install()
    sys.path.insert(0, sys.argv[1])
    import mindspore_lenet_elastic as ex
    n, batch, seed = 1000, 8, 5
    stream = np.concatenate([np.random.default_rng(seed + k).permutation(n) for k in range(3)])
    position, trained = 0, []
    for size, steps in ((1, 7), (2, 30), (3, 11), (1, 40), (2, 50)):  # crosses pass boundaries
        shards = [ex.stream_indices(n, position, r, size, batch, steps, seed).reshape(steps, batch)
                  for r in range(size)]
        trained.append(np.concatenate(shards, axis=1).ravel())  # step by step, rank by rank
        position += steps * size * batch
    trained = np.concatenate(trained)
    print("equal:", np.array_equal(trained, stream[:position]), sorted(trained[:n]) == list(range(n)), position)
""")


def test_example_stream_covers_every_sample_once_across_resizes(tmp_path):
    """examples/mindspore_lenet_elastic.py's shards: for any sequence of cluster sizes, the
    workers' batches of each step are the next size * batch samples of the seeded stream, pass
    after pass, so no sample is trained twice or skipped in a pass."""
    script = tmp_path / "stream.py"
    script.write_text(_STREAM)
    env = dict(os.environ, **ENV)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, str(script), os.path.dirname(EXAMPLE)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert "equal: True True 1920" in res.stdout, res.stdout + res.stderr[-3000:]


_BAD_RESIZE = textwrap.dedent("""
    import mindspore as ms
    import mindspore.ops.operations.kungfu_comm_ops as kfops
    from mindspore._c_expression import kungfu_current_rank, kungfu_current_cluster_size
    resize = kfops.KungFuResize()
    for n in (0, 5):
        try:
            changed, detached = resize(ms.Tensor(n, ms.uint32))
            print("resize %d: no error" % n, bool(changed), bool(detached), flush=True)
        except RuntimeError as e:
            print("resize %d: %s" % (n, str(e).splitlines()[0]), flush=True)
    print("size still", kungfu_current_cluster_size(), flush=True)
""")


def test_resize_bad_size_fails_on_every_rank(tmp_path):
    script = tmp_path / "bad_resize.py"
    script.write_text(_BAD_RESIZE)
    res = _sdprun("--compat", "kungfu", "-w", "-np", "2", "-H", "localhost:2", sys.executable, str(script),
                  timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for r in range(2):
        line0 = re.search(rf"^\[{r}\]<stdout>:resize 0: (.*)$", res.stdout, re.M)
        line5 = re.search(rf"^\[{r}\]<stdout>:resize 5: (.*)$", res.stdout, re.M)
        assert line0 and "at least 1" in line0.group(1), res.stdout
        assert line5 and "5" in line5.group(1) and "slot" in line5.group(1), res.stdout
        assert f"[{r}]<stdout>:size still 2" in res.stdout
