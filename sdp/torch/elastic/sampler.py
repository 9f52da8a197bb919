"""Horovod's ``ElasticSampler`` (``horovod.torch.elastic.sampler``): a ``DistributedSampler`` that
remembers how far an epoch got, so that after the job re-forms the samples not yet processed are
split over the new set of ranks (none trained twice, none lost)."""
import math
import random

import torch.utils.data

from sdp import api


class ElasticSampler(torch.utils.data.Sampler):
    """Indices of ``dataset`` for this rank: the epoch's order (shuffled with ``seed + epoch``
    when ``shuffle``, the same on every rank), less the first ``processed_num`` already processed
    by the whole job, padded to a multiple of the ranks and taken every ``size()``-th from this
    rank's place.  Call ``record_batch`` after each batch (it counts ``batch_size x size()``
    samples), and ``set_epoch`` at the end of an epoch.  Kept in a
    ``TorchState``, it is saved, restored and synchronized with it.
    Mirrors ``horovod.torch.elastic.ElasticSampler`` (its arguments and defaults)."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = self.rank = self.num_samples = self.total_size = 0
        self.remaining_indices = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new order, nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count a processed batch of ``batch_size`` samples on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def reset(self) -> None:
        """Split what remains of the epoch over the current ranks (after a re-formation)."""
        self.num_replicas, self.rank = api.size(), api.rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = self.remaining_indices[:]
        indices += indices[:self.total_size - len(indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
