"""Gradient compression for the wire.  Mirrors ``horovod.tensorflow.Compression`` /
``smdistributed.dataparallel.tensorflow.Compression`` (``none``, ``fp16``)."""
import tensorflow as tf

from sdp import api


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx) -> tensor``."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Casts floating-point tensors to float16 for the wire — where there is one.  When all
    ranks share a host, the engine reduces through shared memory: no bytes cross a network, and
    numpy's float16 arithmetic (~0.3 GB/s here, against ~3 GB/s for float32: see
    benchmarks/README.md) would cost more than the halved size saves, so tensors go through
    unchanged (and more precise).  The engine accumulates float16 payloads in float32, so sums do
    not overflow or lose small terms on the way."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating and tensor.dtype != tf.float16 and api.has_wire():
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tf.cast(tensor, ctx) if ctx is not None else tensor


class Compression:
    """``Compression.none`` (default) or ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
