"""``BroadcastGlobalVariablesHook`` for ``tf.compat.v1.train.MonitoredTrainingSession``.

Mirrors ``horovod.tensorflow.BroadcastGlobalVariablesHook`` and
``smdistributed.dataparallel.tensorflow.BroadcastGlobalVariablesHook``.  (``tf.estimator`` is not
part of TensorFlow >= 2.16; the hook works with any ``tf.compat.v1`` session that runs hooks.)
"""
import tensorflow as tf

from sdp.tensorflow.functions import broadcast_global_variables


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """``SessionRunHook`` that broadcasts all global variables from ``root_rank`` right after the
    session is created (after initialization or a checkpoint restore), so every rank starts from
    the same state.

    ``root_rank`` (int): the rank whose values everybody receives.  ``device``: not supported; a
    non-empty value raises ``NotImplementedError``.  Use in graph mode (``tf.compat.v1``)."""

    def __init__(self, root_rank, device=""):
        super().__init__()
        if device:
            raise NotImplementedError(f"device={device!r} is not supported: sdp places broadcasts itself")
        self.root_rank = int(root_rank)
        self.device = device
        self.bcast_op = None

    def begin(self):
        """Build the broadcast of every global variable in the session's graph (once per graph)."""
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        """Run the broadcast: every rank starts from ``root_rank``'s variables."""
        session.run(self.bcast_op)
