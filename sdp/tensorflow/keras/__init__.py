"""The Keras face of sdp.  Mirrors ``horovod.tensorflow.keras``: change
``import horovod.tensorflow.keras as hvd`` to ``import sdp.tensorflow.keras as hvd``.

Works with Keras 3 (``tf.keras`` in TensorFlow >= 2.16) and with tf_keras (``TF_USE_LEGACY_KERAS=1``).
"""
import tensorflow as tf

from sdp.common.reduce_ops import Average, ReduceOp, Sum  # noqa: F401
from sdp.tensorflow import (Compression, cross_rank, cross_size, init, is_initialized,  # noqa: F401
                            local_rank, local_size, rank, shutdown, size, start_timeline, stop_timeline)
from sdp.tensorflow import ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled  # noqa: F401
from sdp.tensorflow import mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rocm_built  # noqa: F401
from sdp.tensorflow import collectives as _collectives
from sdp.tensorflow import functions as _functions
from sdp.tensorflow import keras_optimizer as _keras_optimizer
from sdp.tensorflow.gradients import GradientReducer as _GradientReducer
from sdp.tensorflow.gradients import global_process_set
from sdp.tensorflow.keras import callbacks  # noqa: F401
from sdp.tensorflow.optimizer import DistributedOptimizer as _DistributedOptimizer
from sdp.tensorflow.sync_batch_norm import SyncBatchNormalization


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Wrap a Keras optimizer (Keras 3 or tf_keras) so that gradients are averaged (``op=Average``;
    or summed, ``op=Sum``; other ops raise ``ValueError``) over all ranks before they are applied.

    Returns a new optimizer: an instance of a subclass of ``optimizer``'s class with the same name,
    built from ``optimizer.get_config()`` (state is carried over for Keras 3 if it was already
    built).  It works with ``model.fit``, ``apply_gradients`` and ``apply``; ``opt.variables()``
    works as well as ``opt.variables``.  ``device_dense``/``device_sparse``: not supported
    (``NotImplementedError``).  ``compression``: ``Compression.none``/``fp16``.
    ``sparse_as_dense``: densify ``IndexedSlices`` (by default allgathered).
    ``backward_passes_per_step``/``average_aggregated_gradients``: accumulate locally and reduce
    every N passes (the optimizer's iteration counter still advances every pass).
    ``gradient_predivide_factor``, ``num_groups``/``groups``, ``process_set``,
    ``scale_local_gradients``: as in ``sdp.tensorflow.DistributedOptimizer``.  A
    non-Keras optimizer raises ``ValueError``.  Under XLA (``jit_compile=True``) applying raises
    ``sdp.tensorflow.XlaNotSupportedError``.
    Mirrors ``horovod.tensorflow.keras.DistributedOptimizer``."""
    if _keras_optimizer.flavor(optimizer) is None:
        raise ValueError(f"sdp.tensorflow.keras.DistributedOptimizer wraps Keras optimizers; got {optimizer!r} "
                         "(use sdp.tensorflow.DistributedOptimizer for tf.compat.v1.train optimizers)")
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError("op currently only supports Average and Sum")
    return _DistributedOptimizer(optimizer, name, False, device_dense, device_sparse, compression,
                                 sparse_as_dense, op, None, backward_passes_per_step=backward_passes_per_step,
                                 gradient_predivide_factor=gradient_predivide_factor,
                                 average_aggregated_gradients=average_aggregated_gradients,
                                 num_groups=num_groups, groups=groups, process_set=process_set,
                                 scale_local_gradients=scale_local_gradients)


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                                op=Average, backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """``DistributedOptimizer`` that keeps the gradients of ``local_layers`` (a Keras layer or
    a list of them; their ``trainable_weights`` when this is called) local to each rank, divided
    by the set's size if ``scale_local_gradients`` (Horovod's default).  The other arguments are
    ``DistributedOptimizer``'s.  Raises ``ValueError`` if an element of ``local_layers`` is not
    a Keras layer.  Mirrors ``horovod.tensorflow.keras.PartialDistributedOptimizer``."""
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, tf.keras.layers.Layer):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    if not all(isinstance(layer, tf.keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    opt = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                               gradient_predivide_factor, op, backward_passes_per_step,
                               average_aggregated_gradients, 0, groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            opt.register_local_var(var)
    return opt


def broadcast_global_variables(root_rank):
    """Broadcast all global variables from ``root_rank`` (TF1 graph mode; runs the op in the Keras
    session).  Eagerly it raises ``RuntimeError`` (use ``BroadcastGlobalVariablesCallback`` or
    ``sdp.tensorflow.broadcast_variables``).
    Mirrors ``horovod.tensorflow.keras.broadcast_global_variables``."""
    op = _functions.broadcast_global_variables(root_rank)
    return tf.compat.v1.keras.backend.get_session().run(op)


def _eval(t):
    if tf.executing_eagerly():
        return t
    return tf.compat.v1.keras.backend.get_session().run(t)


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """Allreduce a tensor-compatible ``value`` (same shape on every rank); returns the result
    (a tensor eagerly, a numpy value in TF1 graph mode).  ``op`` defaults to Average; ``average``
    is the deprecated spelling.  Mirrors ``horovod.tensorflow.keras.allreduce``."""
    return _eval(_collectives.allreduce(tf.constant(value), name=name, average=average, op=op,
                                        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                        compression=compression))


def allgather(value, name=None):
    """Concatenate every rank's ``value`` along the first dimension.
    Mirrors ``horovod.tensorflow.keras.allgather``."""
    return _eval(_collectives.allgather(tf.constant(value), name=name))


def broadcast(value, root_rank, name=None):
    """Return ``root_rank``'s ``value`` on every rank.  Mirrors ``horovod.tensorflow.keras.broadcast``."""
    return _eval(_collectives.broadcast(tf.constant(value), root_rank, name=name))


def reducescatter(value, name=None, op=Average):
    """Reduce ``value`` over ranks and return this rank's block of the first dimension.
    Mirrors ``horovod.tensorflow.keras.reducescatter``."""
    return _eval(_collectives.reducescatter(tf.constant(value), name=name, op=op))


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none):
    """Load a Keras model saved with (or without) a distributed optimizer, and make its optimizer
    distributed again, with its restored state, so that training resumes where it stopped.

    ``filepath``: a ``.keras`` file (Keras 3) or anything ``tf.keras.models.load_model`` reads.
    ``custom_optimizers``: optimizer classes not known to Keras (registered by class name).
    ``custom_objects``: passed to Keras.  ``compression``: for the restored optimizer.
    The model is set to ``jit_compile=False``.  Raises what ``tf.keras.models.load_model`` raises
    (``ValueError`` for an invalid file).  Mirrors ``horovod.tensorflow.keras.load_model``."""
    objects = {"SyncBatchNormalization": SyncBatchNormalization}
    for cls in custom_optimizers or []:
        objects[cls.__name__] = cls
    objects.update(custom_objects or {})
    model = tf.keras.models.load_model(filepath, custom_objects=objects or None)
    opt = getattr(model, "optimizer", None)
    if opt is not None and _keras_optimizer.flavor(opt) is not None:
        reducer = _GradientReducer(f"DistributedOptimizer.{type(opt).__name__}", compression)
        _keras_optimizer.install(opt, reducer)
    if getattr(model, "jit_compile", False) is True:
        model.jit_compile = False
    return model


__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "broadcast_global_variables", "allreduce", "allgather", "broadcast",
           "reducescatter", "load_model", "callbacks", "init", "shutdown", "size", "local_size", "rank",
           "local_rank", "cross_rank", "cross_size", "is_initialized", "Compression", "Average", "Sum"]
