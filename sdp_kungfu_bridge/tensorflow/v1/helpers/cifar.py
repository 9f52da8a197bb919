"""``kungfu.tensorflow.v1.helpers.cifar``: CIFAR-10 / CIFAR-100 from their Python pickles.

``Cifar10Loader(data_dir=~/var/data/cifar, normalize=False, one_hot=False)`` reads
``cifar-10-batches-py/data_batch_{1..5}`` and ``test_batch``; ``Cifar100Loader`` reads
``cifar-100-python/{train,test}`` (fine labels).  ``load_train()``/``load_test()`` return
``DataSet(images, labels)`` (images uint8 ``[n, 32, 32, 3]``, float32 in [0, 1] with
``normalize``; labels ``[n]``, float32 one-hot with ``one_hot``), ``load_datasets()`` both as
``(train, test)``.  The pickles are the dataset's own distribution format: load only files you
trust (``pickle`` runs code).
"""
import os
import pickle
from collections import namedtuple

import numpy as np

from sdp_kungfu_bridge.tensorflow.v1.helpers.mnist import DataSet, _to_onehot

_default_data_dir = os.path.join(os.path.expanduser("~"), "var/data/cifar")


def _unpickle(path):
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")


class _Loader:
    classes = 10
    label_key = b"labels"

    def __init__(self, data_dir=_default_data_dir, normalize=False, one_hot=False):
        self._data_dir = data_dir
        self._normalize = normalize
        self._one_hot = one_hot

    def _load_batch(self, path):
        x = _unpickle(path)
        images = np.asarray(x[b"data"], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        if self._normalize:
            images = (images / 255.0).astype(np.float32)
        labels = np.array(x[self.label_key])
        if self._one_hot:
            labels = _to_onehot(self.classes, labels)
        return images, labels

    def load_datasets(self):
        return namedtuple(self.__class__.__name__.replace("Loader", "DataSets"), "train test")(
            self.load_train(), self.load_test())


class Cifar10Loader(_Loader):
    def load_train(self):
        parts = [self._load_batch(os.path.join(self._data_dir, "cifar-10-batches-py", f"data_batch_{i}"))
                 for i in range(1, 6)]
        return DataSet(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))

    def load_test(self):
        return DataSet(*self._load_batch(os.path.join(self._data_dir, "cifar-10-batches-py", "test_batch")))


class Cifar100Loader(_Loader):
    classes = 100
    label_key = b"fine_labels"

    def load_train(self):
        return DataSet(*self._load_batch(os.path.join(self._data_dir, "cifar-100-python", "train")))

    def load_test(self):
        return DataSet(*self._load_batch(os.path.join(self._data_dir, "cifar-100-python", "test")))
