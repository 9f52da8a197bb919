"""Horovod Elastic with sdp's PyTorch face: examples/torch_mnist_elastic.py survives the kill -9 of
a worker (as tests/test_elastic_mp.py checks for the TensorFlow example)."""
import os
import re
import sys

import pytest

pytest.importorskip("torch", reason="the PyTorch face needs torch (the torch extra)")

from test_elastic_mp import MNIST_DIR, REPO, _discovery, _env, _kill_worker, _run_until  # noqa: E402


@pytest.mark.slow
def test_torch_mnist_elastic_survives_kill9(tmp_path):
    """3 ranks, kill -9 of worker 2 at step 20 (commits every 10): the two others roll back to
    the last commit, re-form as 2 ranks (the sampler splits what is left over them, the learning
    rate is rescaled) and finish; every sample the sampler counts as trained was trained exactly
    once; both end with the same weights; sdprun exits 0."""
    if not os.path.isdir(MNIST_DIR):
        pytest.skip(f"no MNIST data at {MNIST_DIR}")
    script, _ = _discovery(tmp_path, 3)
    rc, out, fired = _run_until(["-np", "3", "--min-np", "2", "--host-discovery-script", script, sys.executable,
                                 os.path.join(REPO, "examples", "torch_mnist_elastic.py"), "--data-dir", MNIST_DIR,
                                 "--steps", "30"], _env(), "step 20 on 3 ranks", lambda p: _kill_worker(p, "2"),
                                timeout=400)
    assert fired and rc == 0, out[-5000:]
    assert "worker 2 on localhost exited with -9" in out and "epoch 1 with 2 workers" in out, out[-5000:]
    resumed = re.findall(r"sync: rank (\d) of 2 at batch (\d+), weights (\w+)", out)
    assert len(resumed) == 2 and len({r[1:] for r in resumed}) == 1, resumed  # same commit, same weights
    assert int(resumed[0][1]) % 10 == 0 and int(resumed[0][1]) >= 10, resumed
    assert out.count("reset: now rank") == 2, out[-5000:]
    m = re.search(r"samples: (\d+) trained once, (\d+) twice, (\d+) lost \(of (\d+)\)", out)
    assert m and m.group(1) == m.group(4) and m.group(2) == m.group(3) == "0", out[-3000:]
    finals = re.findall(r"final: rank (\d) of 2, weights (\w+)", out)
    assert len(finals) == 2 and len({f[1] for f in finals}) == 1, finals
    assert float(re.search(r"test accuracy: ([\d.]+)", out).group(1)) >= 0.85, out[-3000:]
