"""Horovod Elastic for PyTorch on sdp (``horovod.torch.elastic`` under ``sdprun --compat horovod``).

Launch with ``sdprun -np N --min-np A --max-np B --host-discovery-script SCRIPT python train.py``
(``sdp.launcher.elastic.HorovodElasticDriver``).  Horovod's pattern::

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for batch in loader:             # loader over an ElasticSampler
                ...; state.sampler.record_batch(i, batch_size)
                state.commit()               # every few batches: save + check for new hosts
            state.sampler.set_epoch(state.epoch + 1)

    train(state)

* ``run``: calls ``train(state)`` after ``state.sync()``; when a collective fails because a
  peer died (``HorovodInternalError``) the state goes back to its last ``commit()``, the job
  re-forms from the survivors (new ranks, new engine) and ``train`` is called again after a
  ``sync()`` from the new rank 0; a ``HostsUpdatedInterrupt`` re-forms without rollback.  The
  loop is ``sdp.elastic.run_fn`` (as the TensorFlow face's, ``sdp.tensorflow.elastic``).
* ``TorchState`` (models, optimizers, ``ElasticSampler`` objects and plain attributes,
  see ``sdp.torch.elastic.state``), ``ElasticSampler``
  (``sdp.torch.elastic.sampler``).
"""
from sdp import elastic as _elastic
from sdp.common.errors import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401  (Horovod's names)
from sdp.elastic import ObjectState, State  # noqa: F401
from sdp.torch import ops as _ops
from sdp.torch.elastic.sampler import ElasticSampler
from sdp.torch.elastic.state import TorchState

__all__ = ["TorchState", "ElasticSampler", "run"]


def _reset() -> None:
    """Re-form the job (``sdp.elastic.reset``), forgetting the handles of the old one."""
    _ops.clear()
    _elastic.reset()


def run(func):
    """Horovod's elastic decorator: ``func(state, *args, **kwargs)`` is retried after failures and
    host changes (see the module docstring).  Mirrors ``horovod.torch.elastic.run``."""
    return _elastic.run_fn(func, _reset)
