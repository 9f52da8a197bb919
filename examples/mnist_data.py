"""Offline MNIST loader for the sdp examples.

Reads the original IDX files (gzip-compressed or not) from a directory, so the
examples run without network access::

    (x_train, y_train), (x_test, y_test) = load_mnist("/path/to/mnist")

With ``data_dir=None`` it falls back to ``tf.keras.datasets.mnist.load_data()``,
which downloads the data on first use.

For training, ``load_sharded(data_dir, rank, size)`` gives one rank its equal share of the
training set, ready for a convnet (float32 in [0, 1], shape (N, 28, 28, 1)).

IDX format (big-endian):
  images: uint32 magic 2051, uint32 count, uint32 rows, uint32 cols, then pixels
  labels: uint32 magic 2049, uint32 count, then one uint8 label per item
"""

import gzip
import os
import struct
from pathlib import Path

import numpy as np

IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049

_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def find_mnist_dir():
    """Return a directory holding the MNIST IDX files, or None.

    ``$SDP_MNIST_DIR`` wins if set; otherwise ``../shared/data/mnist`` relative
    to the repository root, if it exists.
    """
    env = os.environ.get("SDP_MNIST_DIR")
    if env:
        return Path(env)
    candidate = (Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "mnist").resolve()
    if candidate.is_dir():
        return candidate
    return None


def _resolve(data_dir, stem):
    """Return the path of ``stem.gz`` or ``stem`` in data_dir (gzip preferred)."""
    for name in (stem + ".gz", stem):
        path = Path(data_dir) / name
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"MNIST file {stem}.gz (or {stem}) not found in {data_dir}")


def _read_bytes(path):
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            return f.read()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path}: cannot read MNIST file: {e}") from e


def _read_idx(path, magic, header_dims):
    """Parse one IDX file; return (dims, payload) after checking the header."""
    data = _read_bytes(path)
    header_len = 4 * (1 + header_dims)
    if len(data) < header_len:
        raise ValueError(f"{path}: file too short for an IDX header ({len(data)} bytes)")
    found_magic, *dims = struct.unpack(">%dI" % (1 + header_dims), data[:header_len])
    if found_magic != magic:
        raise ValueError(f"{path}: bad magic number {found_magic}, expected {magic}")
    payload = np.frombuffer(data, dtype=np.uint8, offset=header_len)
    expected = int(np.prod(dims))
    if payload.size != expected:
        raise ValueError(
            f"{path}: header promises {expected} bytes of data ({dims}), found {payload.size}")
    return dims, payload


def _read_images(path):
    (count, rows, cols), pixels = _read_idx(path, IMAGES_MAGIC, 3)
    return pixels.reshape(count, rows, cols)


def _read_labels(path):
    (count,), labels = _read_idx(path, LABELS_MAGIC, 1)
    if labels.size and labels.max() > 9:
        raise ValueError(f"{path}: label {labels.max()} out of range 0..9")
    return labels


def _load_split(data_dir, split):
    images_stem, labels_stem = _FILES[split]
    images_path = _resolve(data_dir, images_stem)
    labels_path = _resolve(data_dir, labels_stem)
    images = _read_images(images_path)
    labels = _read_labels(labels_path)
    if len(images) != len(labels):
        raise ValueError(
            f"{images_path} has {len(images)} images but {labels_path} has {len(labels)} labels")
    return images, labels


def load_mnist(data_dir=None):
    """Load MNIST as ``((x_train, y_train), (x_test, y_test))``.

    Images are uint8 arrays of shape (N, 28, 28), labels uint8 arrays of shape (N,).
    If ``data_dir`` is None, use ``tf.keras.datasets.mnist.load_data()`` (may download).
    """
    if data_dir is None:
        import tensorflow as tf  # only needed for the download fallback

        (x_train, y_train), (x_test, y_test) = tf.keras.datasets.mnist.load_data()
        return ((x_train.astype(np.uint8), y_train.astype(np.uint8)),
                (x_test.astype(np.uint8), y_test.astype(np.uint8)))
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"MNIST data directory not found: {data_dir}")
    return _load_split(data_dir, "train"), _load_split(data_dir, "test")


def preprocess(images):
    """uint8 images (N, 28, 28) -> float32 in [0, 1] with a channel axis: (N, 28, 28, 1)."""
    return (images.astype(np.float32) / 255.0)[..., np.newaxis]


def load_sharded(data_dir=None, rank=0, size=1):
    """Load MNIST and keep rank ``rank``'s shard of the training set out of ``size``.

    Returns ``((x_shard, y_shard), (x_test, y_test))``: images through ``preprocess`` (float32),
    labels int64.  The shard is every ``size``-th training example from ``rank`` on, cut to
    ``60000 // size`` so that every rank runs the same number of steps (a rank with an extra step
    would wait forever for the others in allreduce).  The test set is whole.  ``data_dir=None``
    means ``find_mnist_dir()``, and if that finds nothing, ``load_mnist(None)`` (download).
    """
    (x_train, y_train), (x_test, y_test) = load_mnist(data_dir or find_mnist_dir())
    per_rank = len(x_train) // size
    x_shard = preprocess(x_train[rank::size][:per_rank])
    y_shard = y_train[rank::size][:per_rank].astype(np.int64)
    return (x_shard, y_shard), (preprocess(x_test), y_test.astype(np.int64))
