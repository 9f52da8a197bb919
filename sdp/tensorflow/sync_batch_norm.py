"""``SyncBatchNormalization``: batch normalization whose batch statistics are averaged over all
ranks during training.  Mirrors ``horovod.tensorflow.SyncBatchNormalization``."""
import tensorflow as tf

from sdp import api
from sdp.common.reduce_ops import ReduceOp
from sdp.tensorflow import ops


def _is_keras3() -> bool:
    return not tf.keras.layers.BatchNormalization.__module__.startswith("tf_keras")


@tf.keras.utils.register_keras_serializable(package="sdp")
class SyncBatchNormalization(tf.keras.layers.BatchNormalization):
    """A ``tf.keras.layers.BatchNormalization`` whose training-time mean and variance are computed
    over the union of all ranks' batches (every rank sees the same statistics; gradients flow
    through the allreduce).  Inference uses the moving statistics, as usual.

    ``fused=True`` (or ``None``) raises ``ValueError``, as in Horovod.  Other arguments are those
    of ``BatchNormalization``.  The layer cannot be compiled with XLA (``supports_jit`` is False, so
    Keras' ``jit_compile="auto"`` leaves it out).  Each rank's batch counts equally, whatever its
    size.  Mirrors ``horovod.tensorflow.SyncBatchNormalization``."""

    def __init__(self, fused=False, **kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if not kwargs.get("name"):
            kwargs["name"] = "sync_batch_normalization"
        if kwargs.get("synchronized"):
            raise ValueError("SyncBatchNormalization synchronizes through sdp; do not pass synchronized=True")
        if not _is_keras3():
            kwargs["fused"] = False
        super().__init__(**kwargs)
        self.supports_jit = False

    def _moments(self, *args, **kwargs):
        mean, variance = super()._moments(*args, **kwargs)
        if not api.is_initialized() or api.size() == 1:
            return mean, variance
        # Var[X] = E[X^2] - E[X]^2, with both expectations averaged over ranks.
        stack = tf.stack([mean, variance + tf.square(mean)])
        name = ops.unique_name(f"SyncBatchNormalization.{self.name}")
        group = ops.allreduce_tensor(stack, name, ReduceOp.AVERAGE)
        group_mean, group_mean_of_square = tf.unstack(group)
        return group_mean, group_mean_of_square - tf.square(group_mean)

    def get_config(self):
        """The layer's Keras config, without ``fused`` (a synchronized layer is never fused)."""
        config = super().get_config()
        config.pop("fused", None)
        return config
