"""Start distributed workers from the same state: mirrors ``kungfu.tensorflow.initializer``.

Every function broadcasts rank 0's values, all variables in one fused operation.
"""
import tensorflow as tf

from sdp_kungfu_bridge import _cluster
from sdp_kungfu_bridge.tensorflow import ops as _ops

__all__ = [
    'broadcast_variables',
    'BroadcastGlobalVariablesCallback',
    'BroadcastGlobalVariablesHook',
    'BroadcastGlobalVariablesOp',
]


def broadcast_variables(variables):
    """Assign rank 0's values to ``variables`` (tf or Keras variables) on every worker.

    Often used with ``tf.GradientTape`` after the first step (when the optimizer's slots exist);
    works eagerly and inside ``tf.function``.  Returns ``None`` eagerly, the grouped assign
    operation in graphs.  Raises ``TypeError`` for something that cannot be assigned."""
    variables = list(variables)
    for v in variables:
        if not hasattr(v, "assign"):
            raise TypeError(f"broadcast_variables: {v!r} is not a variable (it has no assign())")
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    base = _ops.collective_name("broadcast_variables")
    values = _ops.grouped_broadcast([tf.convert_to_tensor(v) for v in variables],
                                    [f"{base}.{i}" for i in range(len(variables))], 0)
    assigns = [_ops.assign(v, x) for v, x in zip(variables, values)]
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if isinstance(a, (tf.Operation, tf.Tensor))])


PER_WORKER_VARIABLES = "sdp_kungfu_per_worker_variables"
"""Graph collection of global variables that differ per worker by design and are never
broadcast (the shard id and shape of ``kungfu.datasets.adaptor``)."""


def BroadcastGlobalVariablesOp():
    """An operator that broadcasts ``tf.compat.v1.global_variables()`` from rank 0: run it once
    in a ``tf.compat.v1.Session`` after initialising the variables.  Leaves out the variables of
    the collection ``PER_WORKER_VARIABLES`` (a dataset adaptor's shard id: broadcast, every
    worker would read rank 0's shard)."""
    skip = {id(v) for v in tf.compat.v1.get_collection(PER_WORKER_VARIABLES)}
    return broadcast_variables([v for v in tf.compat.v1.global_variables() if id(v) not in skip])


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """A session hook that broadcasts global variables once the session is created
    (``tf.compat.v1.train.MonitoredSession`` and estimators)."""

    def __init__(self):
        super().__init__()
        self.bcast_op = None

    def begin(self):
        """Create the broadcast operator."""
        self.bcast_op = BroadcastGlobalVariablesOp()

    def after_create_session(self, session, coord):
        """Broadcast global variables after the session is created."""
        session.run(self.bcast_op)


def _keras_callback_base():
    import keras
    return keras.callbacks.Callback


class _BroadcastGlobalVariablesCallback(_keras_callback_base()):
    """Broadcasts the model's and the optimizer's variables from rank 0 after the first batch
    (when the optimizer has created its state)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.broadcast_done = False

    def on_train_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        _cluster.ensure()
        variables = list(self.model.variables)
        opt = getattr(self.model, "optimizer", None)
        if opt is not None:
            opt_vars = opt.variables
            variables += list(opt_vars() if callable(opt_vars) else opt_vars)
        broadcast_variables(variables)
        self.broadcast_done = True


def BroadcastGlobalVariablesCallback(with_keras=False, *args):
    """A Keras callback that broadcasts global variables at the beginning of training (after
    the first batch, so that the optimizer state exists).  ``with_keras`` is accepted: with
    Keras 3, ``keras`` and ``tf.keras`` callbacks are the same."""
    return _BroadcastGlobalVariablesCallback(*args)
