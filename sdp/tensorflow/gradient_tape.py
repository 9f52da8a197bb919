"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient()`` allreduces the result.

Mirrors ``smdistributed.dataparallel.tensorflow.DistributedGradientTape`` and
``horovod.tensorflow.DistributedGradientTape``.
"""
import itertools

import tensorflow as tf

from sdp.common.reduce_ops import ReduceOp, resolve_op
from sdp.tensorflow import ops
from sdp.tensorflow.compression import Compression

_tape_ids = itertools.count()


def check_devices(device_dense, device_sparse) -> None:
    """SMDDP documents ``device_dense``/``device_sparse`` as not supported: raise if given."""
    for label, value in (("device_dense", device_dense), ("device_sparse", device_sparse)):
        if value:
            raise NotImplementedError(f"{label}={value!r} is not supported: sdp places reductions itself")


def allreduce_gradients(grads, compression, sparse_as_dense, op, prefix, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Allreduce a list of gradients (``None`` entries stay ``None``) in one fused op.

    ``IndexedSlices`` are made dense (correct for every op; sparse allgather is a later
    optimisation).  Returns the reduced gradients, same structure, shapes and dtypes."""
    idx, wire, ctxs = [], [], []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            g = tf.convert_to_tensor(g)
        c, ctx = compression.compress(g)
        idx.append(i)
        wire.append(c)
        ctxs.append(ctx)
    if not wire:
        return list(grads)
    names = [f"{prefix}.grad_{i}" for i in idx]
    reduced = ops.grouped_allreduce_tensors(wire, names, op, prescale_factor, postscale_factor)
    out = list(grads)
    for i, r, ctx in zip(idx, reduced, ctxs):
        out[i] = compression.decompress(r, ctx)
    return out


class DistributedGradientTape(tf.GradientTape):
    """Wraps ``gradtape``: ``gradient()`` returns gradients averaged (``op``) over all ranks.

    Arguments follow SMDDP: ``gradtape`` (a ``tf.GradientTape``), ``device_dense``/``device_sparse``
    (not supported; raise ``NotImplementedError`` if given), ``compression``
    (``Compression.none`` or ``Compression.fp16``), ``sparse_as_dense`` (densify
    ``IndexedSlices``), ``op`` (``ReduceOp``, default AVERAGE).  Horovod's extra keywords
    (``gradient_predivide_factor``, ``num_groups``, ``groups``, ``process_set``,
    ``scale_local_gradients``) are accepted; predivide becomes prescale/postscale factors.
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=ReduceOp.AVERAGE, gradient_predivide_factor=1.0,
                 num_groups=0, groups=None, process_set=None, scale_local_gradients=True):
        check_devices(device_dense, device_sparse)
        # adopt the wrapped tape's recording state (the same trick Horovod uses)
        self.__dict__ = dict(gradtape.__dict__)
        self._sdp_tape = gradtape
        self._sdp_compression = compression
        self._sdp_sparse_as_dense = sparse_as_dense
        self._sdp_op = resolve_op(op)
        self._sdp_prefix = f"DistributedGradientTape.{next(_tape_ids)}"
        self._sdp_pre, self._sdp_post = 1.0, 1.0
        if gradient_predivide_factor != 1.0:
            if self._sdp_op != ReduceOp.AVERAGE:
                raise ValueError("gradient_predivide_factor requires op=Average")
            self._sdp_pre = 1.0 / gradient_predivide_factor
            self._sdp_post = gradient_predivide_factor

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        grads = self._sdp_tape.gradient(target, sources, output_gradients, **kwargs)
        flat = tf.nest.flatten(grads)
        reduced = allreduce_gradients(flat, self._sdp_compression, self._sdp_sparse_as_dense, self._sdp_op,
                                      self._sdp_prefix, self._sdp_pre, self._sdp_post)
        return tf.nest.pack_sequence_as(grads, reduced)
