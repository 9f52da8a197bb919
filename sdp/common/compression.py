"""What the faces' gradient compression shares, framework-free: Horovod's ``Compressor`` interface,
``NoneCompressor`` (tensors unchanged), and whether gradient reducers skip the float16 cast where
no bytes cross a network (``SDP_FP16_SKIP_LOCAL``, see ``sdp.tensorflow.compression``).  Each
face's ``FP16Compressor`` casts with its framework (``sdp.tensorflow.compression``,
``sdp.torch.compression``)."""
import os

SKIP_LOCAL_ENV = "SDP_FP16_SKIP_LOCAL"


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx) -> tensor``.
    Mirrors ``horovod.{tensorflow,torch}.compression.Compressor``."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged: ``compress(t) -> (t, None)``, ``decompress(t, ctx) -> t``.
    Mirrors Horovod's ``NoneCompressor``."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


def skip_local() -> bool:
    """Whether gradient reducers skip the float16 cast without a network (``SDP_FP16_SKIP_LOCAL``,
    default on; ``0``/``false``/``no``/``off`` turns it off)."""
    return os.environ.get(SKIP_LOCAL_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
