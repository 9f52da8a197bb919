"""Horovod Elastic across hosts: ``sdprun --host-discovery-script`` whose hosts come, go and fail.

The numpy worker (tests/workers_elastic.py) counts every committed step once (``done_ok``) and
sums the sizes it trained at (``value``, the same on every rank at the end).  First on pretend
hosts of this machine (``SDP_LAUNCHER_ALLOW_FAKE_HOSTS=1``: the driver's host logic in seconds),
then on emulated hosts (tests/emulated_hosts.py: real sshd, real links; ``sdprun`` on h1).
"""
import os
import re
import signal
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic_run  # noqa: E402
import emulated_hosts  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "workers_elastic.py")


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("SDP_LAUNCHER_ALLOW_FAKE_HOSTS", "SDP_SECRET", "SDP_IFACE"):
        env.pop(k, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _sdprun(*args):
    return [sys.executable, "-m", "sdp.launcher.cli", *args]


def _check_results(run, size):
    """``size`` ranks finished, every committed step once, the same state everywhere; no
    shared-memory file or ipc directory of the job is left."""
    import glob
    if run.job:
        files = glob.glob(f"/dev/shm/sdp-{run.job}-*") + glob.glob(f"/tmp/sdp-{run.job}-*")
        assert not files, files
    rows = run.results()
    out = run.text()[-6000:]
    assert sorted(int(r[0]) for r in rows) == list(range(size)), out
    assert {(r[1], r[5]) for r in rows} == {(str(size), "True")}, out  # every committed step once
    assert len({r[3] for r in rows}) == 1, out  # the same state on every rank


def test_discovery_output_and_rank_placement():
    """The discovery script's lines (Horovod's format) and the rank table of an epoch whose
    members run on hosts in any order."""
    from sdp.launcher import discovery, placement
    text = "h2:2\n# comment\nlocalhost:1\n127.0.0.1\nh3\nbad:x\nh4:100000\nh5:-3\n"
    assert discovery.parse(text, None, 8, names={"localhost"}) == \
        {"h2": 2, "localhost": 2, "h3": 1, "h4": 8, "h5": 0}
    assert discovery.parse("h3\n", 4, 8, names=set()) == {"h3": 4}
    assert discovery.parse("localhost:2\n", None, 8, allow_fake=True) == {"localhost": 2}
    infos = placement.rank_infos(["h1", "h2", "h1", "h3", "h2"])
    assert [(i.local_rank, i.local_size, i.cross_rank, i.cross_size) for i in infos] == \
        [(0, 2, 0, 3), (0, 2, 1, 3), (1, 2, 0, 2), (0, 1, 2, 3), (1, 2, 1, 2)]
    launchers = placement.Launchers()
    assert launchers("localhost") is launchers.local and launchers("") is launchers.local
    assert launchers("h2").name == "ssh" and launchers("h2") is launchers("h2")
    assert placement.Launchers(allow_fake=True)("h2") is not None and not placement.Launchers(
        allow_fake=True).is_remote("h2")


def _add_then_drop(run, disc, a, b, c, while_dropped=lambda: None):
    """A job on ``a:2,b:2`` (discovery); ``c:2`` added at step 8 -> 6 workers at the next commit
    (new ones on ``c``, from rank 0's state); ``b`` dropped at step 24 -> its 2 workers are let go
    at the next commit (exit 0, no rollback); ``while_dropped()`` runs then; 4 finish, every
    committed step once, the same state everywhere."""
    try:
        first = run.progress(lambda d: d["step"] >= 8 and d["host"] == b)
        assert first["size"] == 4
        disc.set(f"{a}:2,{b}:2,{c}:2")
        run.progress(lambda d: d["size"] == 6 and d["host"] == c)
        run.progress(lambda d: d["step"] >= 24)
        disc.set(f"{a}:2,{c}:2")
        run.wait_for(lambda x: "is let go" in x)
        later = run.progress(lambda d: d["size"] == 4, start=run.mark)
        assert later["host"] != b
        while_dropped()
        run.stop()
        assert run.finish() == 0, run.text()[-6000:]
    finally:
        run.kill()
    _check_results(run, 4)
    text = run.text()
    assert len(re.findall(rf"worker \d+ on {b}, let go, exited with 0", text)) == 2, text[-6000:]
    assert "rolling back" not in text, text[-6000:]


def test_fake_hosts_added_then_removed(tmp_path):
    """Pretend hosts hA:2,hB:2; hC:2 added at step 8 -> 6 workers at the next commit (the
    newcomers from rank 0's state); hB dropped later -> its 2 workers are let go at the next
    commit (exit 0, no rollback) and 4 finish; every committed step counted once."""
    disc = elastic_run.Discovery(tmp_path, "hA:2,hB:2")
    run = elastic_run.Run(subprocess.Popen, _sdprun("-np", "4", "--min-np", "2", "--max-np", "8",
                                                     "--host-discovery-script", str(disc.script), sys.executable,
                                                     WORKER),
                          cwd=REPO, env=_env(SDP_LAUNCHER_ALLOW_FAKE_HOSTS=1, PROGRESS=1, STEPS=60, COMMIT=4,
                                             STEP_S=0.1, STOP_FILE=tmp_path / "stop"))
    _add_then_drop(run, disc, "hA", "hB", "hC")


def test_fake_host_stopped_is_blacklisted_then_reused(tmp_path):
    """Pretend hosts hA:2,hB:2, blacklist cooldown 2-3 s: both hB workers stopped (SIGSTOP: a
    machine that hangs): the hA workers get PeerLostError, roll back and name the lost ranks;
    sdprun stops the hB workers, blacklists hB and re-forms as 2; after the cooldown hB (still
    discovered) gets 2 new workers at the next commit; 4 finish, every committed step once."""
    disc = elastic_run.Discovery(tmp_path, "hA:2,hB:2")
    run = elastic_run.Run(subprocess.Popen, _sdprun("-np", "4", "--min-np", "2", "--blacklist-cooldown-range", "2", "3",
                                                     "--host-discovery-script", str(disc.script), sys.executable,
                                                     WORKER),
                          cwd=REPO, env=_env(SDP_LAUNCHER_ALLOW_FAKE_HOSTS=1, PROGRESS=1, STEPS=100, COMMIT=4,
                                             STEP_S=0.1, SDP_PEER_TIMEOUT=5, STOP_FILE=tmp_path / "stop"))
    try:
        seen = {}
        run.progress(lambda d: seen.setdefault(d["rank"], d) and len(seen) == 4 and d["step"] >= 8)
        for d in seen.values():
            if d["host"] == "hB":
                os.kill(d["pid"], signal.SIGSTOP)
        run.wait_for(lambda x: "were lost by their peers and did not ask to re-form; stopping them" in x)
        run.wait_for(lambda x: "host hB blacklisted for" in x)
        run.progress(lambda d: d["size"] == 2, start=run.mark)
        run.progress(lambda d: d["size"] == 4 and d["host"] == "hB", start=run.mark)
        run.stop()
        assert run.finish() == 0, run.text()[-6000:]
    finally:
        run.kill()
    _check_results(run, 4)


def test_remote_host_while_listening_on_loopback_is_refused(tmp_path):
    """A job that started on this machine only listens on 127.0.0.1 (never 0.0.0.0): a remote
    host the script lists later cannot reach it, so it is skipped with an error naming -nic and
    the job finishes as it was."""
    disc = elastic_run.Discovery(tmp_path, "localhost:2")
    run = elastic_run.Run(subprocess.Popen, _sdprun("-np", "2", "--host-discovery-script", str(disc.script),
                                                     sys.executable, WORKER),
                          cwd=REPO, env=_env(PROGRESS=1, STEPS=30, COMMIT=4, STEP_S=0.1))
    try:
        run.progress(lambda d: d["step"] >= 4)
        disc.set("localhost:2,elsewhere.invalid:2")
        run.wait_for(lambda x: "elsewhere.invalid is another host, but sdprun listens on 127.0.0.1" in x
                     and "-nic" in x)
        assert run.finish() == 0, run.text()[-6000:]
    finally:
        run.kill()
    _check_results(run, 2)


# ------------------------------------------------------------------------- emulated hosts

needs_hosts = pytest.mark.skipif(emulated_hosts.unavailable_reason() is not None,
                                 reason=str(emulated_hosts.unavailable_reason()))


#: the numpy worker's settings (tests/workers_elastic.py); remote workers get them through -x
WORKER_SETTINGS = ("PROGRESS", "STEPS", "COMMIT", "STEP_S", "STOP_FILE")


def _start(hosts, tmp_path, discovered, *extra, **env):
    """sdprun on h1 with a discovery script printing ``discovered``; the numpy worker, its
    settings exported with ``-x`` (ssh forwards only ``SDP_*``/``HOROVOD_*``/``TF_*`` and those)."""
    disc = elastic_run.Discovery(tmp_path, discovered)
    exports = [a for k in WORKER_SETTINGS for a in ("-x", k)]
    argv = _sdprun("-np", "4", "--min-np", "2", "--max-np", "8", "--host-discovery-script", str(disc.script),
                   *exports, *extra, sys.executable, WORKER)
    run = elastic_run.Run(lambda a, **kw: hosts.popen("h1", a, **kw), argv, cwd=REPO,
                          env=_env(PROGRESS=1, **{"STEPS": 120, "COMMIT": 4, "STEP_S": 0.1,
                                                  "STOP_FILE": tmp_path / "stop", **env}))
    return disc, run


def _no_worker_left(hosts, names, timeout_s=20.0, job=None):
    """No worker process on ``names``; with ``job`` (the job has ended) no shared-memory file or
    ipc directory of it either (one file system for all hosts)."""
    import glob
    for h in names:
        left = hosts.wait_no_processes(h, match=WORKER, timeout_s=timeout_s)
        assert not left, f"workers left on {h}: {left}"
    if job:
        files = glob.glob(f"/dev/shm/sdp-{job}-*") + glob.glob(f"/tmp/sdp-{job}-*")
        assert not files, files


@needs_hosts
@pytest.mark.slow
def test_hosts_added_then_removed_across_hosts(hosts, tmp_path):
    """The issue's schedule on h1..h3: discovery h1:2,h2:2; h3:2 added at step ~8 -> 6 workers
    (new ones on h3 through ssh, from rank 0's state); h2 dropped at step ~24 -> its workers leave
    at the next commit (exit 0) and no worker of the job runs on h2 any more; 4 finish with every
    committed step once and the same state everywhere; nothing of the job is left on any host."""
    disc, run = _start(hosts, tmp_path, "h1:2,h2:2")
    _add_then_drop(run, disc, "h1", "h2", "h3",
                   while_dropped=lambda: _no_worker_left(hosts, ["h2"], timeout_s=20))
    _no_worker_left(hosts, hosts.names, timeout_s=10, job=run.job)


#: the transport's bound for noticing a dead link (ZeroMQ heartbeats; tests/test_multihost.py)
LINK_DOWN_BOUND_S = 12


@needs_hosts
@pytest.mark.slow
def test_dead_link_rolls_back_blacklists_and_reuses_host(hosts, tmp_path):
    """h1:2,h2:2; h2's link cut mid-epoch: the survivors on h1 get PeerLostError within the
    transport's bound, roll back to the last commit and re-form as 2 (sdprun stops the lost h2
    workers, blacklists h2 for 4-5 s); with the link back and h2 still discovered, h2 gets
    workers again after the cooldown; 4 finish, every committed step once, the same state."""
    import time
    disc, run = _start(hosts, tmp_path, "h1:2,h2:2", "--blacklist-cooldown-range", "4", "5", STEPS=250)
    try:
        run.progress(lambda d: d["step"] >= 10 and d["host"] == "h2")
        t0 = time.monotonic()
        hosts.link("h2", up=False)
        try:
            run.wait_for(lambda x: "rolling back to the last commit" in x)
            detected = time.monotonic() - t0
            run.wait_for(lambda x: "host h2 blacklisted for" in x)
            run.progress(lambda d: d["size"] == 2, start=run.mark)
            reformed = time.monotonic() - t0
        finally:
            hosts.link("h2", up=True)
        run.progress(lambda d: d["size"] == 4 and d["host"] == "h2", start=run.mark)
        run.stop()
        assert run.finish() == 0, run.text()[-6000:]
    finally:
        run.kill()
    print(f"dead link: rollback after {detected:.1f} s, re-formed without h2 after {reformed:.1f} s")
    assert detected < LINK_DOWN_BOUND_S, (detected, run.text()[-6000:])
    assert reformed < LINK_DOWN_BOUND_S + 5, (reformed, run.text()[-6000:])
    _check_results(run, 4)
    _no_worker_left(hosts, hosts.names, timeout_s=30, job=run.job)


@needs_hosts
@pytest.mark.slow
@pytest.mark.parametrize("victim", ["host_h2", "rank0"])
def test_kill9_on_hosts(hosts, tmp_path, victim):
    """h1:2,h2:2: kill -9 of every worker on h2 at once (h2 blacklisted for good: the job goes
    on as 2 on h1) or of the worker that is rank 0 (on h1: the job goes on as 3, rank 0's
    committed state from a survivor); every committed step once, same state, nothing left."""
    disc, run = _start(hosts, tmp_path, "h1:2,h2:2")
    try:
        seen = {}
        run.progress(lambda d: seen.setdefault(d["rank"], d) and len(seen) == 4 and d["step"] >= 8)
        pids = [d["pid"] for d in seen.values() if (d["host"] == "h2" if victim == "host_h2" else d["rank"] == 0)]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)  # one file system and pid space: h2's processes are visible here
        size = 2 if victim == "host_h2" else 3
        run.progress(lambda d: d["size"] == size, start=run.mark)
        run.stop()
        assert run.finish() == 0, run.text()[-6000:]
    finally:
        run.kill()
    _check_results(run, size)
    if victim == "host_h2":
        assert "host h2 blacklisted" in run.text()
    _no_worker_left(hosts, hosts.names, timeout_s=10, job=run.job)


# ------------------------------------------------------------------------- KungFu -w across hosts

KF_WORKER = os.path.join(REPO, "tests", "workers_kungfu_elastic.py")


def _kungfu_hosts_check(stdout, a, b):
    """Steps 1-2 on 2 workers (on ``a``), 3-5 on 4 (``a``, ``b``: the new ranks on the next -H
    host), 6-7 on 1 (rank 0 on ``a``; the highest ranks removed), identical weights everywhere."""
    import json
    recs = [json.loads(line.partition(":")[2]) for line in stdout.splitlines()
            if "<stdout>:{" in line]
    steps = {}
    for r in recs:
        if "step" in r:
            steps.setdefault(r["step"], []).append(r)
    assert sorted(steps) == list(range(1, 8)), stdout[-3000:]
    for s, rows in steps.items():
        n = 2 if s <= 2 else 4 if s <= 5 else 1
        assert sorted(r["rank"] for r in rows) == list(range(n)), (s, rows)
        assert len({r["w"] for r in rows}) == 1, (s, rows)
        hosts = [h for _, h in sorted((r["rank"], r["host"]) for r in rows)]
        assert hosts == {2: [a, a], 4: [a, a, b, b], 1: [a]}[n], (s, hosts)
    assert sum("detached_at" in r for r in recs) == 3, stdout[-3000:]


def test_kungfu_watch_grows_onto_and_shrinks_off_fake_hosts():
    """``sdprun -w -H hA:2,hB:2 -np 2`` (pretend hosts): resize 2 -> 4 -> 1."""
    res = subprocess.run(_sdprun("-w", "-H", "hA:2,hB:2", "-np", "2", sys.executable, KF_WORKER,
                                 '{"2": 4, "5": 1}', "7"), capture_output=True, text=True, timeout=120,
                         cwd=REPO, env=_env(SDP_LAUNCHER_ALLOW_FAKE_HOSTS=1))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    _kungfu_hosts_check(res.stdout, "hA", "hB")


@needs_hosts
@pytest.mark.slow
def test_kungfu_watch_grows_onto_and_shrinks_off_hosts(hosts):
    """``sdprun -w -H h1:2,h2:2 -np 2`` on h1: resize 2 -> 4 starts ranks 2-3 on h2 through ssh,
    4 -> 1 detaches them (and rank 1); the weights agree; nothing is left on h2."""
    res = hosts.run("h1", _sdprun("-w", "-H", "h1:2,h2:2", "-np", "2", sys.executable, KF_WORKER,
                                  '{"2": 4, "5": 1}', "7"), timeout=120, cwd=REPO, env=_env())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    _kungfu_hosts_check(res.stdout, "h1", "h2")
    _no_worker_left(hosts, hosts.names, timeout_s=10)


# ------------------------------------------------------------------------- TensorFlow across hosts

MNIST_DIR = os.environ.get("SDP_MNIST_DIR") or os.path.join(os.path.dirname(REPO), "shared", "data", "mnist")


def _tf_run(hosts, tmp_path, discovered, *argv, np_="2", compat=True, env=None):
    pytest.importorskip("tensorflow")
    disc = elastic_run.Discovery(tmp_path, discovered)
    args = _sdprun(*(["--compat", "horovod"] if compat else []), "-np", np_, "--min-np", "2", "--max-np", "8",
                   "--host-discovery-script", str(disc.script), sys.executable, *argv)
    return disc, elastic_run.Run(lambda a, **kw: hosts.popen("h1", a, **kw), args, cwd=REPO, env=_env(**(env or {})))


@needs_hosts
@pytest.mark.tf
@pytest.mark.slow
def test_horovod_tf2_gradient_tape_pattern_across_hosts(hosts, tmp_path):
    """Horovod's elastic TF2 GradientTape pattern (tests/horovod_user) under --compat horovod on
    h1:1,h2:1; h3:1 added mid-run: 3 workers at the next commit, the one on h3 from rank 0's
    state; the same weights on every rank at the end."""
    disc, run = _tf_run(hosts, tmp_path, "h1:1,h2:1", os.path.join(REPO, "tests", "horovod_user",
                                                                   "tensorflow2_mnist_elastic.py"),
                        env={"SDP_TEST_STOP_AT_SIZE": 3})  # 10 batches after the growth
    try:
        run.wait_for(lambda x: "Step #10" in x, timeout_s=240)
        disc.set("h1:1,h2:1,h3:1")
        assert run.finish(400) == 0, run.text()[-6000:]
    finally:
        run.kill()
    text = run.text()
    assert re.search(r"epoch 1 with 3 workers .*worker 2 on h3", text), text[-6000:]
    done = re.findall(r"DONE rank (\d) size (\d) weights (\w+)", text)
    assert sorted(d[0] for d in done) == ["0", "1", "2"], text[-6000:]
    assert {d[1] for d in done} == {"3"} and len({d[2] for d in done}) == 1, done


@needs_hosts
@pytest.mark.tf
@pytest.mark.slow
def test_horovod_keras_fit_pattern_across_hosts(hosts, tmp_path):
    """Horovod's Keras elastic pattern (model.fit + the elastic callbacks) under --compat horovod
    on h1:1,h2:2: worker 2 (on h2) dies inside fit; the 2 others (h1, h2) roll back and finish
    all 3 epochs with the same weights."""
    disc, run = _tf_run(hosts, tmp_path, "h1:1,h2:2", os.path.join(REPO, "tests", "workers_elastic_keras.py"),
                        np_="3")
    try:
        assert run.finish(400) == 0, run.text()[-6000:]
    finally:
        run.kill()
    text = run.text()
    assert "epoch 1 with 2 workers" in text and "rolling back to the last commit" in text, text[-6000:]
    done = re.findall(r"DONE (\d) (\d) (\d) (\w+)", text)
    assert sorted(d[0] for d in done) == ["0", "1"], text[-6000:]
    assert {d[1:3] for d in done} == {("2", "3")} and len({d[3] for d in done}) == 1, done


@needs_hosts
@pytest.mark.tf
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SDP_TEST_ACCEPTANCE") != "1",
                    reason="MNIST on up to 6 TensorFlow workers takes minutes; set SDP_TEST_ACCEPTANCE=1")
def test_mnist_elastic_example_three_hosts_add_and_drop(hosts, tmp_path):
    """Acceptance: examples/tf2_mnist_elastic.py, discovery h1:2,h2:2, h3:2 added at batch 50,
    h2 dropped at batch 150: no batch twice or lost, the same final weights on every rank, test
    accuracy >= 0.97, no worker left on h2 after it was dropped, nothing left anywhere."""
    if not os.path.isdir(MNIST_DIR):
        pytest.skip(f"no MNIST data at {MNIST_DIR}")
    disc, run = _tf_run(hosts, tmp_path, "h1:2,h2:2", os.path.join(REPO, "examples", "tf2_mnist_elastic.py"),
                        "--data-dir", MNIST_DIR, np_="4", compat=False)
    try:
        run.wait_for(lambda x: "step 50/" in x, timeout_s=300)
        disc.set("h1:2,h2:2,h3:2")
        run.wait_for(lambda x: "step 150/" in x, timeout_s=300)
        disc.set("h1:2,h3:2")
        run.wait_for(lambda x: "is let go" in x, timeout_s=120)
        run.wait_for(lambda x: "epoch 2 with 4 workers" in x, timeout_s=120)
        _no_worker_left(hosts, ["h2"], timeout_s=20)
        assert run.finish(600) == 0, run.text()[-6000:]
    finally:
        run.kill()
    text = run.text()
    m = re.search(r"batches: (\d+) trained once, (\d+) twice, (\d+) lost \(of (\d+)\)", text)
    assert m and m.group(1) == m.group(4) and m.group(2) == m.group(3) == "0", text[-3000:]
    finals = re.findall(r"final: rank (\d) of (\d), weights (\w+)", text)
    assert len(finals) == 4 and len({f[2] for f in finals}) == 1, finals
    acc = float(re.search(r"test accuracy: ([\d.]+)", text).group(1))
    print(f"mnist elastic across 3 hosts: {m.group(0)}, test accuracy {acc}")
    assert acc >= 0.97, text[-3000:]
    _no_worker_left(hosts, hosts.names, timeout_s=10)


@needs_hosts
@pytest.mark.tf
@pytest.mark.slow
def test_kungfu_elastic_mnist_example_across_hosts(hosts):
    """The examples' KungFu elastic MNIST script with ``sdprun -w -H h1:2,h2:2 -np 2`` on h1 and
    a short schedule: 2 workers, 4 after step 3 (ranks 2-3 on h2 through ssh, synchronised from
    rank 0), 1 after step 6 (ranks 1-3 detach); rank 0 finishes alone; nothing is left on h2."""
    pytest.importorskip("tensorflow")
    if not os.path.isdir(MNIST_DIR):
        pytest.skip(f"no MNIST data at {MNIST_DIR}")
    res = hosts.run("h1", _sdprun("-w", "-H", "h1:2,h2:2", "-np", "2", sys.executable,
                                  os.path.join(REPO, "examples", "kungfu_elastic_mnist.py"), "--data-dir", MNIST_DIR,
                                  "--schedule", "3:4,6:1", "--max-step", "8", "--batch-size", "32"),
                    timeout=300, cwd=REPO, env=_env())
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    synced = re.findall(r"\[(\d)\]<stdout>:rank (\d)/4: synchronised at step 3", out)
    assert sorted(r for _, r in synced) == ["0", "1", "2", "3"], out[-4000:]
    assert out.count("detached after step 6") == 3, out[-4000:]
    assert "finished at step 8 with 1 workers" in out, out[-4000:]
    _no_worker_left(hosts, hosts.names, timeout_s=10)
