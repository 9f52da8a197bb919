"""An unmodified KungFu-style script (tests/workers_kungfu_script.py) under ``sdprun --compat kungfu``."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("sdp.compat")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kungfu_script_runs_unmodified_under_compat():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update({"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"})
    res = subprocess.run([sys.executable, "-m", "sdp.launcher.cli", "--compat", "kungfu", "-np", "2",
                          "python", os.path.join(REPO, "tests", "workers_kungfu_script.py")],
                         capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    for r in range(2):
        assert f"[{r}]<stdout>:kungfu module: sdp_kungfu_bridge.python" in res.stdout
        # S-SGD after a broadcast from rank 0: identical models on both workers
        assert f"[{r}]<stdout>:rank {r} of 2: max spread 0" in res.stdout
