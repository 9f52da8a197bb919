"""Offline MNIST loader for the sdp examples.

Reads the original IDX files (gzip-compressed or not) from a directory, so the
examples run without network access::

    (x_train, y_train), (x_test, y_test) = load_mnist("/path/to/mnist")

With ``data_dir=None`` it looks for them (``find_mnist_dir``), else falls back to Keras' copy,
``mnist.npz`` in ``$KERAS_HOME/datasets`` (``~/.keras/datasets``), downloaded on first use
(``download_mnist``: one process per path downloads, the others wait for it; a file there that is
not Keras' is never replaced or deleted).  Offline, that ends the process with one line saying what
to pass (``--data-dir`` or ``SDP_MNIST_DIR``).

For training, ``load_sharded(data_dir, rank, size)`` gives one rank its equal share of the
training set, ready for a convnet (float32 in [0, 1], shape (N, 28, 28, 1)).

IDX format (big-endian):
  images: uint32 magic 2051, uint32 count, uint32 rows, uint32 cols, then pixels
  labels: uint32 magic 2049, uint32 count, then one uint8 label per item
"""

import fcntl
import gzip
import hashlib
import os
import shutil
import struct
import urllib.request
from pathlib import Path

import numpy as np

IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049

#: Keras' copy of MNIST (``keras.datasets.mnist.load_data``) and its SHA-256
MNIST_URL = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz"
MNIST_SHA256 = "731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1"
OFFLINE_HINT = "pass --data-dir DIR (a directory with MNIST's four IDX .gz files) or set SDP_MNIST_DIR=DIR"

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


def keras_cache_path():
    """Where Keras keeps ``mnist.npz``: ``$KERAS_HOME/datasets``, else ``~/.keras/datasets``."""
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return Path(home) / "datasets" / "mnist.npz"


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_mnist(path=None):
    """The path of Keras' ``mnist.npz`` at ``path`` (default ``keras_cache_path()``), downloaded
    from ``MNIST_URL`` if it is not there.

    Under a lock on the directory, so that of the processes sharing it one downloads and the
    others wait and use its file; into a temporary file, renamed into place once its SHA-256 is
    ``MNIST_SHA256``.  A file already at ``path`` is used only when it is Keras' file, and never
    replaced or deleted.  Raises ``SystemExit`` with one line (which names ``--data-dir`` and
    ``SDP_MNIST_DIR``) when the file there is another one or the download fails."""
    path = Path(path or keras_cache_path())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(path.parent, os.O_RDONLY)
    except OSError as e:
        raise SystemExit(f"cannot use {path.parent} for MNIST ({e.strerror}): {OFFLINE_HINT}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            if _sha256(path) == MNIST_SHA256:
                return path
            raise SystemExit(f"{path} is not Keras' MNIST file (its SHA-256 differs; left as it is): "
                             f"move it away, or {OFFLINE_HINT}")
        part = path.with_name(f".{path.name}.{os.getpid()}.part")
        try:
            with urllib.request.urlopen(MNIST_URL, timeout=60) as response, open(part, "wb") as f:
                shutil.copyfileobj(response, f)
            if _sha256(part) != MNIST_SHA256:
                raise SystemExit(f"the file downloaded from {MNIST_URL} is not Keras' MNIST file: {OFFLINE_HINT}")
            os.replace(part, path)
        except OSError as e:  # (urllib's URLError is one)
            why = getattr(e, "reason", None) or e.strerror or e
            raise SystemExit(f"cannot download MNIST from {MNIST_URL} ({why}): {OFFLINE_HINT}") from None
        finally:
            part.unlink(missing_ok=True)
        return path
    finally:
        os.close(lock)


def load_mnist(data_dir=None):
    """Load MNIST as ``((x_train, y_train), (x_test, y_test))``.

    Images are uint8 arrays of shape (N, 28, 28), labels uint8 arrays of shape (N,).
    If ``data_dir`` is None: ``find_mnist_dir()``, else Keras' ``mnist.npz`` (``download_mnist``).
    """
    data_dir = data_dir or find_mnist_dir()
    if data_dir is None:
        with np.load(download_mnist(), allow_pickle=False) as f:
            return ((f["x_train"].astype(np.uint8), f["y_train"].astype(np.uint8)),
                    (f["x_test"].astype(np.uint8), f["y_test"].astype(np.uint8)))
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
    means ``find_mnist_dir()``, and if that finds nothing, Keras' ``mnist.npz`` (download).
    """
    (x_train, y_train), (x_test, y_test) = load_mnist(data_dir)
    per_rank = len(x_train) // size
    x_shard = preprocess(x_train[rank::size][:per_rank])
    y_shard = y_train[rank::size][:per_rank].astype(np.int64)
    return (x_shard, y_shard), (preprocess(x_test), y_test.astype(np.int64))
