"""Horovod Elastic on sdp: ``sdprun --host-discovery-script`` re-forms a job when a worker dies or
a slot is added, and ``sdp.elastic``'s state/run loop rolls back to the last commit and syncs the
new workers (tests/workers_elastic.py is the numpy worker: seconds per job).  The MNIST runs
(examples/tf2_mnist_elastic.py, Horovod's own pattern under --compat horovod) are at the end."""
import os
import re
import stat
import subprocess
import sys
import time

import pytest

from sdp.launcher import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "workers_elastic.py")
RESULT = re.compile(r"RESULT rank=(\d+) size=(\d+) epoch=(\d+) value=(\S+) resets=(\[.*?\]) done_ok=(\w+)")


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop(cli.ALLOW_FAKE_HOSTS_ENV, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _discovery(tmp_path, slots: int):
    """A discovery script that prints the contents of a file (``localhost:<slots>``)."""
    hosts = tmp_path / "hosts"
    hosts.write_text(f"localhost:{slots}\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script), hosts


def _sdprun(args, env, timeout=120):
    return subprocess.run([sys.executable, "-m", "sdp.launcher.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def _results(stdout):
    return [RESULT.search(line).groups() for line in stdout.splitlines() if RESULT.search(line)]


def test_killed_worker_job_goes_on_from_last_commit(tmp_path):
    """3 workers, worker 2 SIGKILLs itself at step 12 (commits every 5): the two others roll back
    to step 10, re-form as ranks 0-1 of 2 and finish; every step counted once; sdprun exits 0."""
    script, _ = _discovery(tmp_path, 3)
    res = _sdprun(["-np", "3", "--min-np", "2", "--host-discovery-script", script, sys.executable, WORKER],
                  _env(DIE_WORKER=2, DIE_STEP=12, STEPS=30))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    rows = _results(res.stdout)
    assert sorted(r[0] for r in rows) == ["0", "1"], out[-4000:]
    for rank, size, epoch, value, resets, done_ok in rows:
        assert (size, epoch, resets, done_ok) == ("2", "1", "[2]", "True"), out[-4000:]
        assert float(value) == 10 * 3 + 20 * 2  # steps 0-9 on 3 ranks, the rest on 2: none twice
    assert "worker 2 on localhost exited with -9; the job goes on without that slot" in res.stderr


def test_added_slot_grows_job_and_newcomer_gets_rank0_state(tmp_path):
    """2 workers; the discovery script adds a slot: at the next commit the job re-forms as 3 and
    the new worker starts from rank 0's state (same value on every rank, steps counted once)."""
    script, hosts = _discovery(tmp_path, 2)
    proc = subprocess.Popen([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", "--min-np", "2", "--max-np", "3",
                             "--host-discovery-script", script, sys.executable, WORKER],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=_env(STEPS=60, STEP_S=0.1))
    try:
        time.sleep(3)
        hosts.write_text("localhost:3\n")
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, (stdout + stderr)[-4000:]
    rows = _results(stdout)
    assert sorted(r[0] for r in rows) == ["0", "1", "2"], (stdout + stderr)[-4000:]
    assert {(r[1], r[2], r[5]) for r in rows} == {("3", "1", "True")}
    assert len({r[3] for r in rows}) == 1  # rank 0's state everywhere
    assert sorted(r[4] for r in rows) == ["[3]", "[3]", "[]"]  # survivors reset, the newcomer did not
    assert "hosts changed (localhost:3)" in stderr


def test_below_min_np_stops_job(tmp_path):
    """2 workers with --min-np 2: a killed worker leaves 1, no slot comes back (the failed one is
    not reused while localhost runs a live worker) -> sdprun stops after --elastic-timeout."""
    script, _ = _discovery(tmp_path, 2)
    t0 = time.monotonic()
    res = _sdprun(["-np", "2", "--min-np", "2", "--elastic-timeout", "2", "--host-discovery-script", script,
                   sys.executable, WORKER], _env(DIE_WORKER=1, DIE_STEP=3, STEPS=30))
    assert res.returncode == 128 + 9, (res.stdout + res.stderr)[-4000:]
    assert "1 workers, below --min-np 2, for --elastic-timeout 2 s" in res.stderr
    assert "sdprun ended the elastic job" in res.stderr  # the survivor was told
    assert time.monotonic() - t0 < 60


def test_reset_limit_stops_job(tmp_path):
    script, _ = _discovery(tmp_path, 3)
    res = _sdprun(["-np", "3", "--min-np", "2", "--reset-limit", "0", "--host-discovery-script", script,
                   sys.executable, WORKER], _env(DIE_WORKER=0, DIE_STEP=3, STEPS=30))
    assert res.returncode == 128 + 9, (res.stdout + res.stderr)[-4000:]
    assert "--reset-limit 0 reached" in res.stderr


def test_elastic_flags_checked():
    res = _sdprun(["-np", "2", "--min-np", "3", "--host-discovery-script", "/bin/true", "true"], _env())
    assert res.returncode == 2 and "--min-np (3) <= -np (2)" in res.stderr
