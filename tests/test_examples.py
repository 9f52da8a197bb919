"""Examples end to end: the flagship on real MNIST, and the synthetic benchmark, real processes
through sdprun."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from mnist_data import find_mnist_dir  # noqa: E402

MNIST = find_mnist_dir()
mnist_only = pytest.mark.skipif(MNIST is None, reason="MNIST not found: set SDP_MNIST_DIR or provide ../shared/data/mnist")


def run(cmd, timeout=400):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


@mnist_only
def test_tf2_mnist_two_ranks_agree_and_learn():
    out = run([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", sys.executable, "examples/tf2_mnist.py",
               "--data-dir", str(MNIST), "--steps", "150"])
    acc = float(re.search(r"\[0\]<stdout>:test accuracy: ([0-9.]+)", out).group(1))
    sums = re.findall(r"\[(\d)\]<stdout>:weights checksum: ([0-9a-f]+)", out)
    assert acc >= 0.93, out[-2000:]
    assert len(sums) == 2 and sums[0][1] == sums[1][1], sums


@mnist_only
def test_tf2_mnist_without_launcher():
    out = run([sys.executable, "examples/tf2_mnist.py", "--data-dir", str(MNIST), "--steps", "40"])
    assert "test accuracy:" in out and "weights checksum:" in out


@pytest.mark.parametrize("model", ["MobileNetV2", "ResNet50"])
def test_tf2_synthetic_benchmark_runs(model):
    """Horovod's synthetic benchmark step: the gradients in one bucket (MobileNetV2, 14 MB: the
    function's blocking op) or several (ResNet50, 94 MB: submit ops and a blocking wait), then on
    the first batch ``broadcast_variables`` inside the same ``tf.function`` (it once failed with
    '899 nodes in a cycle')."""
    out = run([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", sys.executable,
               "examples/tf2_synthetic_benchmark.py", "--model", model, "--image-size", "32",
               "--batch-size", "4", "--num-warmup-batches", "2", "--num-iters", "1", "--num-batches-per-iter", "1"])
    assert re.search(r"\[0\]<stdout>:Total img/sec on 2 rank\(s\): [0-9.]+", out), out[-2000:]
