"""The PyTorch example end to end on real MNIST, real processes through sdprun (as
tests/test_examples.py does for the TensorFlow ones)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the PyTorch example needs torch (the torch extra)")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from mnist_data import find_mnist_dir  # noqa: E402

MNIST = find_mnist_dir()
mnist_only = pytest.mark.skipif(MNIST is None,
                                reason="MNIST not found: set SDP_MNIST_DIR or provide ../shared/data/mnist")


@mnist_only
def test_torch_mnist_two_ranks_agree_and_learn():
    """DistributedOptimizer on 2 ranks: the model learns and both ranks end with the same weights."""
    p = subprocess.run([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", sys.executable, "examples/torch_mnist.py",
                        "--data-dir", str(MNIST), "--steps", "60"], cwd=ROOT, capture_output=True, text=True,
                       timeout=400, env=dict(os.environ))
    out = p.stdout
    assert p.returncode == 0, out[-3000:] + p.stderr[-3000:]
    acc = float(re.search(r"\[0\]<stdout>:test accuracy: ([0-9.]+)", out).group(1))
    sums = re.findall(r"\[(\d)\]<stdout>:weights checksum: ([0-9a-f]+)", out)
    assert acc >= 0.9, out[-2000:]
    assert len(sums) == 2 and sums[0][1] == sums[1][1], sums


@mnist_only
def test_horovod_users_pytorch_script_under_compat():
    """A Horovod user's PyTorch MNIST script (tests/horovod_user/pytorch_mnist.py: Horovod's
    pytorch_mnist.py shape, fp16 compression, imports horovod.torch only) under
    ``sdprun --compat horovod -np 2``: it trains and the ranks end with equal weights."""
    p = subprocess.run([sys.executable, "-m", "sdp.launcher.cli", "--compat", "horovod", "-np", "2", sys.executable,
                        "tests/horovod_user/pytorch_mnist.py", "--data-dir", str(MNIST), "--max-batches", "40",
                        "--fp16-allreduce"], cwd=ROOT, capture_output=True, text=True, timeout=400,
                       env=dict(os.environ))
    out = p.stdout
    assert p.returncode == 0, out[-3000:] + p.stderr[-3000:]
    acc = float(re.search(r"\[0\]<stdout>:Test set: Average loss: [0-9.]+, Accuracy: ([0-9.]+)%", out).group(1))
    sums = re.findall(r"\[(\d)\]<stdout>:weights checksum: ([0-9a-f]+)", out)
    assert acc >= 20.0, out[-2000:]  # (chance is 10%: 40 batches of SGD)
    assert len(sums) == 2 and sums[0][1] == sums[1][1], sums
