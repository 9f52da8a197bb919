"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient()`` reduces the result over
all ranks, and ``PartialDistributedGradientTape``, which keeps some layers' gradients local.

Mirrors ``smdistributed.dataparallel.tensorflow.DistributedGradientTape`` and
``horovod.tensorflow.{DistributedGradientTape, PartialDistributedGradientTape}``.
"""
import tensorflow as tf

from sdp import api

from sdp.common.reduce_ops import ReduceOp
from sdp.tensorflow.compression import Compression, gradient_compression
from sdp.tensorflow.gradients import (GradientReducer, check_devices, check_process_set,  # noqa: F401
                                      global_process_set, resolve_groups)


class DistributedGradientTape(tf.GradientTape):
    """Wraps ``gradtape``; ``gradient()`` returns the gradients reduced (``op``) over all ranks.

    Arguments (SMDDP's, then Horovod's):
      gradtape: the ``tf.GradientTape`` that recorded the computation (``TypeError`` otherwise).
      device_dense, device_sparse: not supported; a non-empty value raises ``NotImplementedError``
        (as SMDDP documents).
      compression: ``Compression.none`` (default) or ``Compression.fp16`` (floats travel as
        float16 and come back in their own dtype; skipped while no rank is across a network,
        unless ``SDP_FP16_SKIP_LOCAL=0``: see ``sdp.tensorflow.compression.gradient_compression``).
      sparse_as_dense: make ``tf.IndexedSlices`` gradients dense before the allreduce; by default
        they are allgathered (values and indices) and stay ``IndexedSlices``.
      op: ``ReduceOp``/``hvd.Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product``, ``Adasum``
        (Horovod's adaptive summation of the gradients, per variable, no averaging: float
        gradients, a power-of-two number of ranks, the global process set; see ``sdp.engine.adasum``).
      gradient_predivide_factor: with AVERAGE, scale by ``1/f`` before and ``f/size`` after the sum.
      num_groups, groups: accepted and validated as Horovod does; no effect on the results (the
        engine fuses all gradients of a call by itself).
      process_set: the ranks that reduce together (``hvd.ProcessSet``; default all); only they
        may call ``gradient()``, and AVERAGE divides by the set's size.
      scale_local_gradients: divide gradients of sources registered with
        ``register_local_source`` by ``size()`` (Horovod's default, True).

    ``gradient(target, sources, output_gradients=None, ...)`` returns the same structure, shapes
    and dtypes as ``tf.GradientTape.gradient``.  Every rank must call it with the same sources.
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=ReduceOp.AVERAGE, gradient_predivide_factor=1.0,
                 num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True):
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
        check_devices(device_dense, device_sparse)
        api.process_set_id(process_set)  # a registered set (membership is checked when reducing)
        resolve_groups(num_groups, groups)
        # Adopt the wrapped tape's recording state (the tape keeps recording into the same place).
        self.__dict__ = dict(gradtape.__dict__)
        self._sdp_tape = gradtape
        self._sdp_reducer = GradientReducer("DistributedGradientTape", gradient_compression(compression),
                                            sparse_as_dense, op, gradient_predivide_factor, scale_local_gradients,
                                            process_set)
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients

    def register_local_source(self, source):
        """Keep the gradient of ``source`` (a variable) local: it is not reduced over ranks (and is
        divided by ``size()`` if ``scale_local_gradients``).  Mirrors Horovod's method."""
        self._sdp_reducer.register_local(source)

    def gradient(self, target, sources, output_gradients=None, unconnected_gradients=None,
                 use_generic_names=False):
        """``tf.GradientTape.gradient``'s gradients of ``target`` for ``sources`` (same structure),
        reduced over the ranks (see the class docstring); every rank must call it with the same
        sources."""
        kwargs = {} if unconnected_gradients is None else {"unconnected_gradients": unconnected_gradients}
        grads = self._sdp_tape.gradient(target, sources, output_gradients, **kwargs)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        flat_sources = tf.nest.flatten(sources)
        variables = flat_sources if len(flat_sources) == len(flat_grads) else None
        reduced = self._sdp_reducer.reduce(flat_grads, variables)
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """``gradient``, split by kind of source: returns ``(local_vars_grads,
        global_vars_grads)``, two lists of ``(source, gradient)`` pairs (source first, unlike
        ``apply_gradients``' pairs), in the order of ``sources``: the sources registered with
        ``register_local_source`` (their gradients local, scaled as ``gradient`` does)
        and all others (reduced over the ranks).  A collective like ``gradient``: every rank
        calls it with the same sources.  Mirrors Horovod's method (horovod.tensorflow, 0.28)."""
        grads = self.gradient(target, sources, output_gradients=output_gradients,
                              use_generic_names=use_generic_names)
        local_vars_grads, global_vars_grads = [], []
        for s, g in zip(tf.nest.flatten(sources), tf.nest.flatten(grads, expand_composites=False)):
            (local_vars_grads if self._sdp_reducer.is_local(s) else global_vars_grads).append((s, g))
        return local_vars_grads, global_vars_grads


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                                   sparse_as_dense=False, op=ReduceOp.AVERAGE, gradient_predivide_factor=1.0,
                                   num_groups=0, groups=None, process_set=global_process_set,
                                   local_layers=None, scale_local_gradients=True):
    """A ``DistributedGradientTape`` that keeps the gradients of ``local_layers`` (a Keras
    layer or a list of them) local to each rank.  Mirrors
    ``horovod.tensorflow.PartialDistributedGradientTape``.  Raises ``ValueError`` if an element of
    ``local_layers`` is not a Keras layer."""
    if local_layers is None:
        local_layers = []
    elif _is_layer(local_layers):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    if not all(_is_layer(layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape


def _is_layer(obj) -> bool:
    return isinstance(obj, tf.keras.layers.Layer)
