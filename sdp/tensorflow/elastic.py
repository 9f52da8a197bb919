"""Horovod Elastic for TensorFlow (``horovod.tensorflow.elastic``; the same module under
``sdprun --compat horovod``).

Launch with ``sdprun -np N --min-np A --max-np B --host-discovery-script SCRIPT python train.py``
(see ``sdp.launcher.elastic.HorovodElasticDriver``).  Use (Horovod's pattern)::

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...                     # training steps (collectives)
            state.commit()          # every few batches: save + check for new hosts

    train(state)

* ``run``: calls ``train(state)`` after ``state.sync()``; when a collective fails because a
  peer died (``HorovodInternalError``, or a TensorFlow op error whose
  cause is an sdp error) the state goes back to its last ``commit()``, the job re-forms from the
  survivors (new ranks 0..n-1, new engine and shared memory), the state is synced from the new
  rank 0 and ``train`` is called again.  A ``HostsUpdatedInterrupt``
  (new slots, raised by ``commit()``/``check_host_updates()`` on every rank at once) re-forms
  the job without rollback.  The loop is ``sdp.elastic.run_fn``.
* ``TensorFlowKerasState`` (a built Keras model and its optimizer, plus keyword attributes),
  ``TensorFlowState`` (a list of ``tf.Variable``), ``ObjectState`` (attributes only):
  ``save``/``commit``/``restore``/``sync``/``check_host_updates``/``register_reset_callbacks``
  as in Horovod.  Variables are saved as numpy copies; ``sync`` broadcasts rank 0's values
  (named ``elastic.sync.<i>``) and attributes.
"""
import numpy as np
import tensorflow as tf

from sdp import api
from sdp import elastic as _elastic
from sdp.common.errors import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401  (Horovod's names)
from sdp.elastic import ObjectState, State  # noqa: F401

__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState",
           "HorovodInternalError", "HostsUpdatedInterrupt"]

# Messages of sdp errors as TensorFlow shows them when they end a graph op (py_function).
_SDP_ERROR_MARKS = ("lost connection to rank", "PeerLostError", "sdp was shut down", "CollectiveTimeoutError",
                    "StallError", "HorovodInternalError")


def _is_internal_error(e: BaseException) -> bool:
    """A TensorFlow op error caused by a failed sdp collective (a lost peer...)."""
    return isinstance(e, tf.errors.OpError) and any(m in str(e) for m in _SDP_ERROR_MARKS)


def run(func):
    """Horovod's elastic decorator: ``func(state, *args, **kwargs)`` is retried after failures and
    host changes (see the module docstring).  Mirrors ``horovod.tensorflow.elastic.run``."""
    return _elastic.run_fn(func, _elastic.reset, _is_internal_error)


def _values(variables):
    return [np.array(v.numpy(), copy=True) for v in variables]


def _broadcast_variables(variables, root_rank: int = 0) -> None:
    """Assign ``root_rank``'s values to ``variables`` (every rank passes the same list)."""
    variables = list(variables)
    if not variables:
        return
    handles = api.grouped_broadcast_async([np.ascontiguousarray(v.numpy()) for v in variables], root_rank,
                                          [f"elastic.sync.{i}" for i in range(len(variables))])
    for v, h in zip(variables, handles):
        v.assign(np.reshape(h.wait(), v.shape))


def _optimizer_variables(optimizer):
    if optimizer is None:
        return []
    v = optimizer.variables
    return list(v() if callable(v) else v)


class TensorFlowState(ObjectState):
    """Elastic state of a list of ``tf.Variable`` (default: every global variable of a
    ``tf.compat.v1`` graph is not supported; give ``variables``) plus keyword attributes.
    Mirrors ``horovod.tensorflow.elastic.TensorFlowState`` (eager mode; ``session`` must be None)."""

    def __init__(self, variables=None, session=None, **kwargs):
        if session is not None or variables is None:
            raise NotImplementedError("TensorFlowState: sdp supports eager variables only: pass variables=[...] "
                                      "and no session")
        self.variables = list(variables)
        self._saved_values = _values(self.variables)
        super().__init__(**kwargs)

    def save(self):
        """Copy the variables' values (and the attributes) as the state to go back to."""
        self._saved_values = _values(self.variables)
        super().save()

    def restore(self):
        """Assign the values of the last ``save`` back to the variables (and the attributes)."""
        for v, x in zip(self.variables, self._saved_values):
            v.assign(x)
        super().restore()

    def sync(self):
        """Broadcast rank 0's variables and attributes to every rank (a collective)."""
        _broadcast_variables(self.variables, 0)
        self._saved_values = _values(self.variables)
        super().sync()


class TensorFlowKerasState(ObjectState):
    """Elastic state of a built Keras ``model`` and its ``optimizer`` (default
    ``model.optimizer``) plus keyword attributes (``batch=0, epoch=0``...).  The optimizer's
    variables must exist on every rank before ``sync`` (run one step first, as Horovod's examples
    do).  Mirrors ``horovod.tensorflow.elastic.TensorFlowKerasState``; raises ``ValueError`` for a
    model that is not built."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.backend = backend
        self._save_model()
        super().__init__(**kwargs)

    def _variables(self):
        return list(self.model.variables) + _optimizer_variables(self.optimizer)

    def _save_model(self):
        self._saved_model_state = _values(self._variables())

    def save(self):
        """Copy the model's and the optimizer's variables (and the attributes) as the state to go
        back to."""
        self._save_model()
        super().save()

    def restore(self):
        """Assign the values of the last ``save`` back to the model and the optimizer."""
        for v, x in zip(self._variables(), self._saved_model_state):
            v.assign(x)
        super().restore()

    def sync(self):
        """Broadcast rank 0's model and optimizer variables and attributes (a collective)."""
        _broadcast_variables(self._variables(), 0)
        self._save_model()
        super().sync()
