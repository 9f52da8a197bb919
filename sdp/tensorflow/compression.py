"""Gradient compression for the wire.  Mirrors ``horovod.tensorflow.Compression`` /
``smdistributed.dataparallel.tensorflow.Compression`` (``none``, ``fp16``).

``Compression.fp16`` keeps Horovod's contract exactly: ``compress(t)`` returns ``(float16 tensor,
t.dtype)`` for every floating ``t`` (float16, bfloat16, float32, float64) and ``(t, t.dtype)``
unchanged otherwise; ``decompress(t, ctx)`` casts back to ``ctx`` when it is floating.

Where the cast does not pay, sdp skips it, at the place that issues the gradient collectives
(``DistributedGradientTape`` and every ``DistributedOptimizer`` pass their ``compression``
through ``gradient_compression``): when every rank shares this host's memory, the engine
reduces through shared memory, no bytes cross a network, and numpy's float16 arithmetic (~0.3
GB/s here, against ~3 GB/s for float32: see benchmarks/README.md) costs more than the halved size
saves; gradients then travel in their own dtype (and more precisely).  ``SDP_FP16_SKIP_LOCAL=0``
turns the skip off (gradients are always cast when ``Compression.fp16`` is asked for).  Explicit
collectives (``hvd.allreduce(t, compression=Compression.fp16)``) always cast, as in Horovod.  The
engine accumulates float16 payloads in float32, so sums do not overflow or lose small terms.
"""
import tensorflow as tf

from sdp import api
from sdp.common.compression import SKIP_LOCAL_ENV, Compressor, NoneCompressor, skip_local  # noqa: F401


class FP16Compressor(Compressor):
    """Casts every floating-point tensor (float16, bfloat16, float32, float64) to float16;
    others pass unchanged.  ``ctx`` is the input's ``tf.DType``; ``decompress`` casts back to it
    when it is floating.  Mirrors ``horovod.tensorflow.compression.FP16Compressor``."""

    @staticmethod
    def compress(tensor):
        compressed = tf.cast(tensor, tf.float16) if tensor.dtype.is_floating else tensor
        return compressed, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tf.cast(tensor, ctx) if ctx is not None and ctx.is_floating else tensor


class WireFP16Compressor(Compressor):
    """``FP16Compressor`` when collectives cross a network (``sdp.api.has_wire()``, decided
    when ``compress`` runs); otherwise tensors pass unchanged (``ctx`` ``None``).  What
    ``gradient_compression`` gives gradient reducers for ``Compression.fp16``."""

    @staticmethod
    def compress(tensor):
        if api.has_wire():
            return FP16Compressor.compress(tensor)
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return FP16Compressor.decompress(tensor, ctx)


def gradient_compression(compression):
    """The compressor a gradient reducer (tape, optimizer) uses for the user's ``compression``:
    ``WireFP16Compressor`` for ``Compression.fp16`` while ``skip_local`` holds,
    ``Compression.none`` for ``None``, else ``compression`` itself."""
    if compression is None:
        return NoneCompressor
    if compression is FP16Compressor and skip_local():
        return WireFP16Compressor
    return compression


class Compression:
    """``Compression.none`` (default) or ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
