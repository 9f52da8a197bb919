"""The eager side of the TensorFlow face: tensors to what the engine takes and its results back
to tensors (numpy views in, DLPack out, no copy), and the common eager ``hvd.allreduce`` straight
to ``sdp.api``.  Kept apart from ``sdp.tensorflow.ops`` (the collectives over tensors) and
``sdp.tensorflow.graph_ops`` (graph ops) because nothing here builds a graph op.

**Eagerly** a collective hands read-only views of its inputs to ``sdp.api`` (no copy), waits
on the Python thread that called it, and returns the engine's results as tensors through DLPack
(no copy when the engine aligned them on 64 bytes, as it does).  No graph op round trip;
gradients come from ``tf.custom_gradient``, set up only while a tape may record.
"""
import functools

import numpy as np
import tensorflow as tf

from sdp import api
from sdp.common import errors as _errors
from sdp.common.reduce_ops import ReduceOp
from sdp.engine import fusion
from sdp.engine.fusion import ALIGN_BYTES  # results start on this boundary: TensorFlow's EIGEN_MAX_ALIGN_BYTES
from sdp.tensorflow.errors import as_tf_error


@functools.lru_cache(maxsize=None)
def _device_path() -> bool:
    from sdp.common.util import cuda_built
    return cuda_built()


def eager_input(t):
    """An eager tensor as the engine takes it: a GPU tensor as a DLPack capsule when sdp can
    reduce on the device (PyCUDA installed: the engine's device path, no host copy), anything
    else as a numpy view."""
    if _device_path() and "GPU" in (getattr(t, "device", "") or "").upper():
        return tf.experimental.dlpack.to_dlpack(t)
    return np.asarray(t)


def _to_tensor(arr, dtype, np_dtype=None):
    """An engine result as an eager tensor of ``dtype`` (through DLPack without a copy when
    ``as_output`` can; a device result comes as a DLPack capsule).  ``np_dtype``: the numpy
    dtype ``arr`` has if known (an allreduce's result has its input's)."""
    if type(arr) is not np.ndarray:
        if type(arr).__name__ == "PyCapsule":
            return tf.experimental.dlpack.from_dlpack(arr)
        arr = np.asarray(arr, dtype=_numpy_dtype(dtype))
    elif arr.dtype is not np_dtype:
        arr = np.asarray(arr, dtype=_numpy_dtype(dtype))
    out = as_output(arr)
    return out if isinstance(out, tf.Tensor) else tf.convert_to_tensor(out, dtype)


_NUMPY_DTYPES = {}  # tf.DType -> its numpy dtype (``as_numpy_dtype`` costs ~0.45 us a call)


def _numpy_dtype(dtype):
    got = _NUMPY_DTYPES.get(dtype)
    if got is None:
        got = _NUMPY_DTYPES[dtype] = dtype.as_numpy_dtype
    return got



def as_output(arr: np.ndarray):
    """``arr`` as an eager result: a tensor sharing its memory (through DLPack) when
    TensorFlow can use that memory as it is (C-contiguous, 64-byte aligned, as the engine's
    results are; TensorFlow aborts on a misaligned one), else ``arr`` itself, which TensorFlow
    copies (~6 GB/s here, 9 ms for 56 MB of gradients per step)."""
    step = fusion.compiled()
    if (step.exportable(arr) if step is not None else  # (~0.1 us, where the attributes below take ~1.5)
            arr.size and arr.flags.c_contiguous and arr.flags.writeable and arr.ctypes.data % ALIGN_BYTES == 0):
        try:
            return _from_dlpack(arr.__dlpack__())
        except (BufferError, TypeError, ValueError, tf.errors.OpError):  # a dtype DLPack does not carry
            pass
    return arr


_from_dlpack = tf.experimental.dlpack.from_dlpack


def eager_allreduce(t, name: str, op: ReduceOp, prescale_factor, postscale_factor):
    """``allreduce_tensor`` of one eager tensor of the global set, as Horovod's eager
    ``allreduce`` is mostly called, without its layers (a list, a batch, the gradient's wrapper,
    the TF dtype's check), or None where that does not apply (not executing eagerly, a tape that
    could record, an op that is not a ``ReduceOp`` or is Adasum, a tensor whose numpy view
    is not of an integer or float dtype, a GPU tensor where the device path is built): 1 KB
    13.9 -> ~6.7 us here, over a floor (numpy view, ``sdp.allreduce``, DLPack back) of 4.8."""
    if (not tf.executing_eagerly() or _could_record() or type(op) is not ReduceOp or op is ReduceOp.ADASUM
            or _device_path()):
        return None
    try:
        x = np.asarray(t)
    except (TypeError, ValueError, tf.errors.OpError):  # (a dtype numpy cannot view)
        return None
    if x.dtype.kind not in "iuf":  # (that, bool, strings, bfloat16: the layers check them, naming TF's dtype)
        return None
    try:
        got = api.allreduce(x, name, op, float(prescale_factor), float(postscale_factor))
    except _errors.TensorMismatchError as e:  # (tf_errors' mapping without its with block: ~0.2 us)
        new = as_tf_error(e)
        if new is e:
            raise
        raise new from e
    if type(got) is np.ndarray and got.dtype is x.dtype:
        out = as_output(got)
        if out is not got:  # (a tensor over the result's memory)
            return out
    return _to_tensor(got, t.dtype, x.dtype)



@functools.lru_cache(maxsize=None)
def _record_check():
    """TensorFlow's ``could_possibly_record`` (looked up once), or None where its internals moved."""
    try:
        from tensorflow.python.eager import record
    except ImportError:  # pragma: no cover - TF internals moved
        return None
    return record.could_possibly_record


def _always() -> bool:
    return True


#: () -> False when no ``tf.GradientTape`` could record an eager op now (``tf.custom_gradient``
#: costs ~0.1 ms per call, for nothing then); True where TensorFlow's check moved
_could_record = _record_check() or _always
