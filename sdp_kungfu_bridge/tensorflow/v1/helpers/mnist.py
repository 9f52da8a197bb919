"""``kungfu.tensorflow.v1.helpers.mnist``: MNIST (or Fashion-MNIST) from a directory of IDX files.

``load_datasets(data_dir, normalize=False, one_hot=False, padded=False)`` reads
``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and
``t10k-labels-idx1-ubyte`` (each also as ``.gz``, as they are distributed) and returns
``MnistDataSets(train, test)``, each a ``DataSet(images, labels)``: images uint8 ``[n, 28, 28]``
(``padded``: ``[n, 32, 32, 1]``, zero borders of 2), ``normalize``: float32 in [0, 1]; labels
uint8 ``[n]``, ``one_hot``: float32 ``[n, 10]``.  ``load_mnist_data(data_dir, prefix, normalize,
one_hot, padded=False)`` reads one of ``prefix`` ``"train"``/``"t10k"`` (``ValueError`` otherwise).
Missing files raise ``FileNotFoundError`` naming the path.
"""
import os
from collections import namedtuple

import numpy as np

from sdp_kungfu_bridge.tensorflow.v1.helpers.idx import read_idx_file

DataSet = namedtuple("DataSet", "images labels")
MnistDataSets = namedtuple("MnistDataSets", "train test")


def _to_onehot(k, labels):
    out = np.zeros((len(labels), k), np.float32)
    out[np.arange(len(labels)), np.asarray(labels, np.int64)] = 1
    return out


def load_mnist_data(data_dir, prefix, normalize, one_hot, padded=False):
    if prefix not in ("train", "t10k"):
        raise ValueError("prefix must be train | t10k")
    images = read_idx_file(os.path.join(data_dir, prefix + "-images-idx3-ubyte"))
    if padded:
        images = np.pad(images.reshape(images.shape[0], 28, 28, 1), ((0, 0), (2, 2), (2, 2), (0, 0)), "constant")
    if normalize:
        images = (images / 255.0).astype(np.float32)
    labels = read_idx_file(os.path.join(data_dir, prefix + "-labels-idx1-ubyte"))
    if one_hot:
        labels = _to_onehot(10, labels)
    return DataSet(images, labels)


def load_datasets(data_dir, normalize=False, one_hot=False, padded=False):
    return MnistDataSets(load_mnist_data(data_dir, "train", normalize, one_hot, padded=padded),
                         load_mnist_data(data_dir, "t10k", normalize, one_hot, padded=padded))
