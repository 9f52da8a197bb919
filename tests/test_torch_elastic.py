"""Horovod Elastic with sdp's PyTorch face: examples/torch_mnist_elastic.py survives the kill -9 of
a worker and then grows when a slot is added (as tests/test_elastic_mp.py checks for the
TensorFlow example)."""
import os
import re
import subprocess
import sys
import threading

import pytest

pytest.importorskip("torch", reason="the PyTorch face needs torch (the torch extra)")

from test_elastic_mp import MNIST_DIR, REPO, _discovery, _env, _kill_worker  # noqa: E402


def _run_with_events(args, env, events, timeout=400):
    """Run sdprun (output merged); for each ``(trigger, action)`` of ``events`` in turn, call
    ``action(proc)`` once a line contains ``trigger``.  Returns (returncode, output, how many
    actions ran).  The job is killed after ``timeout``."""
    proc = subprocess.Popen([sys.executable, "-m", "sdp.launcher.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env, start_new_session=True)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    lines, fired = [], 0
    try:
        for line in proc.stdout:
            lines.append(line)
            if fired < len(events) and events[fired][0] in line:
                events[fired][1](proc)
                fired += 1
        proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(lines), fired


@pytest.mark.slow
def test_torch_mnist_elastic_survives_kill9_then_grows(tmp_path):
    """3 ranks, kill -9 of worker 2 at step 20 (commits every 10): the two others roll back to the
    last commit and re-form as 2 ranks (the sampler splits what is left over them, the learning
    rate is rescaled); then the discovery script shows a fourth slot and at the next commit the job
    grows to 3 (4 slots, one failed), the newcomer taking rank 0's model, optimizer and sampler
    state.  Every sample the sampler counts as trained was trained exactly once; all end with the
    same weights; sdprun exits 0.  (70 steps: sdprun sees the new slot one discovery poll after
    the write, by step 30-50 on 2 cores, and a commit must still be to come; with 50 the job
    ended first once in 4 suite runs.)"""
    if not os.path.isdir(MNIST_DIR):
        pytest.skip(f"no MNIST data at {MNIST_DIR}")
    script, hosts = _discovery(tmp_path, 3)
    rc, out, fired = _run_with_events(
        ["-np", "3", "--min-np", "2", "--max-np", "4", "--host-discovery-script", script, sys.executable,
         os.path.join(REPO, "examples", "torch_mnist_elastic.py"), "--data-dir", MNIST_DIR, "--steps", "70"], _env(),
        [("step 20 on 3 ranks", lambda p: _kill_worker(p, "2")),
         ("sync: rank 0 of 2", lambda p: hosts.write_text("localhost:4\n"))])
    assert fired == 2 and rc == 0, out[-5000:]
    assert "worker 2 on localhost exited with -9" in out and "epoch 1 with 2 workers" in out, out[-5000:]
    assert "epoch 2 with 3 workers" in out, out[-5000:]
    resumed = re.findall(r"sync: rank (\d) of 2 at batch (\d+), weights (\w+)", out)
    assert len(resumed) == 2 and len({r[1:] for r in resumed}) == 1, resumed  # same commit, same weights
    assert int(resumed[0][1]) % 10 == 0 and int(resumed[0][1]) >= 10, resumed
    grown = re.findall(r"sync: rank (\d) of 3 at batch (\d+), weights (\w+)", out)[-3:]
    assert sorted(g[0] for g in grown) == ["0", "1", "2"] and len({g[1:] for g in grown}) == 1, grown
    m = re.search(r"samples: (\d+) trained once, (\d+) twice, (\d+) lost \(of (\d+)\)", out)
    assert m and m.group(1) == m.group(4) and m.group(2) == m.group(3) == "0", out[-3000:]
    finals = re.findall(r"final: rank (\d) of 3, weights (\w+)", out)
    assert len(finals) == 3 and len({f[1] for f in finals}) == 1, finals
    assert float(re.search(r"test accuracy: ([\d.]+)", out).group(1)) >= 0.85, out[-3000:]
