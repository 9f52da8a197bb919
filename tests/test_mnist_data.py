"""Tests for the offline MNIST loader used by the examples (examples/mnist_data.py)."""

import gzip
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES_DIR) not in sys.path:
    sys.path.insert(0, str(EXAMPLES_DIR))

import mnist_data  # noqa: E402

FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


@pytest.fixture(scope="module")
def mnist_dir():
    d = mnist_data.find_mnist_dir()
    if d is None:
        pytest.skip("MNIST IDX files not found: set SDP_MNIST_DIR or provide ../shared/data/mnist")
    if not Path(d).is_dir():
        pytest.skip(f"SDP_MNIST_DIR={d} is not a directory")
    return Path(d)


def _write_idx_gz(path, magic, dims, payload):
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">%dI" % (1 + len(dims)), magic, *dims))
        f.write(bytes(payload))


def _tiny_dataset(d, n=3):
    """Write a small, valid MNIST-shaped dataset (gzip) into directory d."""
    for prefix in ("train", "t10k"):
        _write_idx_gz(d / f"{prefix}-images-idx3-ubyte.gz", 2051, (n, 28, 28),
                      np.arange(n * 28 * 28, dtype=np.uint8))
        _write_idx_gz(d / f"{prefix}-labels-idx1-ubyte.gz", 2049, (n,),
                      np.arange(n, dtype=np.uint8))


def test_real_data_shapes_and_dtypes(mnist_dir):
    (x_train, y_train), (x_test, y_test) = mnist_data.load_mnist(mnist_dir)
    assert x_train.shape == (60000, 28, 28)
    assert y_train.shape == (60000,)
    assert x_test.shape == (10000, 28, 28)
    assert y_test.shape == (10000,)
    for a in (x_train, y_train, x_test, y_test):
        assert a.dtype == np.uint8
    for y in (y_train, y_test):
        assert y.min() == 0 and y.max() == 9
        assert len(np.unique(y)) == 10
    # Real images are not blank.
    assert 0 < x_train.mean() < 255 and x_test.max() == 255


def test_find_mnist_dir_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SDP_MNIST_DIR", str(tmp_path))
    assert Path(mnist_data.find_mnist_dir()) == tmp_path


def test_small_valid_files_roundtrip(tmp_path):
    _tiny_dataset(tmp_path)
    (x_train, y_train), (x_test, y_test) = mnist_data.load_mnist(tmp_path)
    assert x_train.shape == (3, 28, 28) and x_test.shape == (3, 28, 28)
    assert y_train.tolist() == [0, 1, 2] and y_test.tolist() == [0, 1, 2]
    assert x_train.ravel()[:5].tolist() == [0, 1, 2, 3, 4]


def test_uncompressed_files_accepted(tmp_path):
    _tiny_dataset(tmp_path)
    for name in FILES:
        gz = tmp_path / name
        with gzip.open(gz, "rb") as src, open(tmp_path / name[:-3], "wb") as dst:
            shutil.copyfileobj(src, dst)
        gz.unlink()
    (x_train, y_train), _ = mnist_data.load_mnist(tmp_path)
    assert x_train.shape == (3, 28, 28) and y_train.shape == (3,)


def test_wrong_magic_names_file(tmp_path):
    _tiny_dataset(tmp_path)
    bad = tmp_path / "train-labels-idx1-ubyte.gz"
    _write_idx_gz(bad, 2051, (3,), np.zeros(3, np.uint8))  # image magic in a label file
    with pytest.raises(ValueError, match="train-labels-idx1-ubyte.gz") as info:
        mnist_data.load_mnist(tmp_path)
    assert "magic" in str(info.value)


def test_truncated_payload_names_file(tmp_path):
    _tiny_dataset(tmp_path)
    bad = tmp_path / "t10k-images-idx3-ubyte.gz"
    _write_idx_gz(bad, 2051, (3, 28, 28), np.zeros(100, np.uint8))
    with pytest.raises(ValueError, match="t10k-images-idx3-ubyte.gz"):
        mnist_data.load_mnist(tmp_path)


def test_count_mismatch_raises(tmp_path):
    _tiny_dataset(tmp_path)
    _write_idx_gz(tmp_path / "train-labels-idx1-ubyte.gz", 2049, (2,), np.zeros(2, np.uint8))
    with pytest.raises(ValueError, match="train-labels-idx1-ubyte.gz"):
        mnist_data.load_mnist(tmp_path)


def test_not_gzip_names_file(tmp_path):
    _tiny_dataset(tmp_path)
    bad = tmp_path / "train-images-idx3-ubyte.gz"
    bad.write_bytes(b"definitely not gzip data")
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz"):
        mnist_data.load_mnist(tmp_path)


def test_missing_file_names_file(tmp_path):
    _tiny_dataset(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        mnist_data.load_mnist(tmp_path)


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        mnist_data.load_mnist(tmp_path / "nope")
