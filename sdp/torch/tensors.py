"""torch tensors in and out of ``sdp.api`` without copies: what both PyTorch faces share.

``sdp.api`` takes numpy arrays (host memory) and ``__cuda_array_interface__`` / DLPack objects
(device memory, see ``sdp.engine.device_arrays``); this module turns a ``torch.Tensor`` into
that and the engine's results back into tensors on the input's device:

- ``as_input``: a CPU tensor becomes a numpy view of its memory (``Tensor.numpy()`` of the
  detached tensor; bfloat16, which numpy lacks, as its bits viewed as ``ml_dtypes.bfloat16``, the
  name the engine reduces); a CUDA tensor becomes a ``CudaTensor``, which names the caller's
  *current* stream (``__cuda_array_interface__`` v3, so the engine waits on it before reading)
  and gives bfloat16 through DLPack.  A non-contiguous tensor is made contiguous first (a copy).
- ``as_tensor``: a result (numpy array, or a tensor the engine made through
  ``torch.from_dlpack``) as a ``torch.Tensor`` sharing its memory (bfloat16 bits viewed back).
- ``out_array``: the numpy array an in-place host collective writes into (the caller's own
  memory), or None where the result must be copied in (``copy_into``: CUDA, non-contiguous).

Dtypes: bool, uint8, int8-64, float16, bfloat16, float32, float64 (as ``sdp.api`` carries them;
reductions do not take bool with Average).  Other dtypes (complex, quantized, float8) raise
``ValueError`` naming the dtype (Horovod's class for "Tensor type ... is not supported").  The
engine never imports torch; this module is a face's.
"""
from typing import Optional

import numpy as np
import torch

_BF16 = None  # np.dtype(ml_dtypes.bfloat16), read at the first bfloat16 tensor
NUMPY_VIEWS = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                         torch.float16, torch.float32, torch.float64})
"""The dtypes whose contiguous CPU tensors ``Tensor.numpy()`` views as they are, without a copy:
every dtype sdp carries but bfloat16 (which numpy lacks)."""
_CARRIED = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
            torch.bfloat16, torch.float32, torch.float64}


def _bf16() -> np.dtype:
    global _BF16
    if _BF16 is None:
        import ml_dtypes  # (the engine's name for bfloat16: sdp.engine.coordinator reads it so)
        _BF16 = np.dtype(ml_dtypes.bfloat16)
    return _BF16


def check_dtype(tensor: torch.Tensor, what: str = "collective") -> None:
    """``ValueError`` unless sdp carries ``tensor``'s dtype (see the module docstring)."""
    if tensor.dtype not in _CARRIED:
        raise ValueError(f"{what}: torch dtype {tensor.dtype} is not supported (bool, uint8, int8-int64, "
                        "float16, bfloat16, float32, float64 are)")


class CudaTensor:
    """A contiguous CUDA ``torch.Tensor`` as the engine's device path reads it: its
    ``__cuda_array_interface__`` (v3) names the stream that was current when this was made (the
    engine waits on it; PyTorch's own interface is v2 and names none), ``__dlpack__`` is the
    tensor's (bfloat16, which has no interface typestr, goes that way, synchronised with the
    legacy default stream).  Its ``__module__`` is ``torch``, so the engine hands results back
    through ``torch.from_dlpack``: CUDA tensors on the same device."""

    __slots__ = ("tensor", "stream")
    __module__ = "torch"  # (results: sys.modules["torch"].from_dlpack, see DeviceTensor.wrap_result)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        handle = torch.cuda.current_stream(tensor.device).cuda_stream
        self.stream = handle or 1  # (0, PyTorch's default stream, is the legacy default: 1 in the interface)

    @property
    def __cuda_array_interface__(self) -> dict:
        cai = dict(self.tensor.__cuda_array_interface__)  # (TypeError for bfloat16: no typestr)
        cai["version"], cai["stream"] = 3, self.stream
        return cai

    def __dlpack__(self, stream=None, **kw):
        return self.tensor.__dlpack__(stream=stream, **kw)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


def as_input(tensor: torch.Tensor, what: str = "collective"):
    """``tensor`` as ``sdp.api`` takes it, without a copy where it is contiguous: a numpy view
    (CPU) or a ``CudaTensor`` (CUDA).  ``ValueError`` for a dtype sdp does not carry;
    ``TypeError`` for a tensor neither on the CPU nor on a CUDA device, or a non-tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.is_neg():  # (a lazily negated view, torch._neg_view: its values made real, a copy)
        t = t.resolve_neg()
    if t.dtype not in _CARRIED:
        check_dtype(t, what)
    if t.is_cuda:
        return CudaTensor(t)
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(_bf16())
    try:
        return t.numpy()
    except TypeError:  # (a tensor on another device: meta, mps, ...)
        raise TypeError(f"{what}: tensors on {t.device} are not supported (CPU and CUDA are)") from None


def in_place(tensor: torch.Tensor, arr) -> Optional[np.ndarray]:
    """``out_array`` of ``tensor`` given ``arr = as_input(tensor)``, without making it again:
    ``arr`` where it is ``tensor``'s own memory (a contiguous CPU tensor), else None."""
    return arr if type(arr) is np.ndarray and tensor.is_contiguous() and arr.flags.writeable else None


def out_array(tensor: torch.Tensor) -> Optional[np.ndarray]:
    """The numpy view an in-place host collective may write its result into: ``tensor``'s own
    memory (CPU, contiguous), else None (the result is copied in with ``copy_into``)."""
    if tensor.is_cuda or not tensor.is_contiguous() or tensor.device.type != "cpu":
        return None
    arr = as_input(tensor)
    return arr if arr.flags.writeable else None


def as_tensor(result, device: Optional[torch.device] = None) -> torch.Tensor:
    """A result of ``sdp.api`` as a ``torch.Tensor`` sharing its memory: a numpy array through
    ``torch.from_numpy`` (bfloat16 through its bits; a read-only result is copied, as PyTorch
    cannot mark a tensor read-only), a tensor as it is, any other DLPack object through
    ``torch.from_dlpack``.  ``device``: where a host result must go (a CUDA tensor's
    collective that came back in host memory), None to leave it on the CPU."""
    if type(result) is np.ndarray:
        arr = result if result.flags.writeable else result.copy()
        if arr.dtype.kind == "V":  # (bfloat16, ml_dtypes': torch.from_numpy does not know it)
            out = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        else:
            out = torch.from_numpy(arr)
    elif isinstance(result, torch.Tensor):
        out = result
    else:
        out = torch.from_dlpack(result)
    if device is not None and out.device != device:
        out = out.to(device)
    return out


def copy_into(tensor: torch.Tensor, result) -> torch.Tensor:
    """Write ``result`` into ``tensor`` (the caller's own, for the in-place collectives) and
    return ``tensor``; nothing is copied where ``result`` already is ``tensor``'s memory."""
    src = as_tensor(result)
    if src.data_ptr() != tensor.data_ptr() or src.device != tensor.device:
        with torch.no_grad():
            tensor.copy_(src.view(tensor.shape) if src.shape != tensor.shape else src)
    return tensor
