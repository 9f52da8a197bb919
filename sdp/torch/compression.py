"""Gradient compression for the wire.  Mirrors ``horovod.torch.compression`` (``Compression.none``,
``Compression.fp16``; under ``sdprun --compat horovod`` this module is ``horovod.torch.compression``).

``Compression.fp16`` keeps Horovod's contract: ``compress(t)`` returns ``(t as float16, t.dtype)``
for every floating ``t`` and ``(t, t.dtype)`` otherwise; ``decompress(t, ctx)`` casts back to a
floating ``ctx``.  Explicit collectives (``hvd.allreduce(t, compression=Compression.fp16)``)
always cast; ``DistributedOptimizer`` skips the cast where no bytes
cross a network (as the TensorFlow face does, ``SDP_FP16_SKIP_LOCAL``, see
``sdp.tensorflow.compression``): ``gradient_compression``.
"""
import torch

from sdp import api
from sdp.common.compression import Compressor, NoneCompressor, skip_local


class FP16Compressor(Compressor):
    """Casts floating-point tensors to float16 and back.  Mirrors
    ``horovod.torch.compression.FP16Compressor``."""

    @staticmethod
    def compress(tensor):
        return (tensor.to(torch.float16) if tensor.dtype.is_floating_point else tensor), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx) if ctx is not None and ctx.is_floating_point else tensor


class _WireFP16Compressor(Compressor):
    """``FP16Compressor`` when collectives cross a network (``sdp.api.has_wire()``), else
    tensors unchanged (``ctx`` None)."""

    @staticmethod
    def compress(tensor):
        return FP16Compressor.compress(tensor) if api.has_wire() else (tensor, None)

    @staticmethod
    def decompress(tensor, ctx):
        return FP16Compressor.decompress(tensor, ctx)


def gradient_compression(compression):
    """What a gradient reducer uses for the user's ``compression``: ``Compression.fp16`` cast only
    across a network unless ``SDP_FP16_SKIP_LOCAL`` is ``0``/``false``/``no``/``off``."""
    if compression is None:
        return NoneCompressor
    return _WireFP16Compressor if compression is FP16Compressor and skip_local() else compression


class Compression:
    """``Compression.none`` (default) or ``Compression.fp16``.  Mirrors ``horovod.torch.Compression``."""

    none = NoneCompressor
    fp16 = FP16Compressor
