"""The TensorFlow 2 face of sdp.

Mirrors ``smdistributed.dataparallel.tensorflow`` and ``horovod.tensorflow``: change
``import horovod.tensorflow as hvd`` (or ``import smdistributed.dataparallel.tensorflow as sdp``)
to ``import sdp.tensorflow as hvd`` and the script runs on sdp.
"""
from sdp import api as _api
from sdp.api import (cross_rank, cross_size, is_initialized, local_rank, local_size,  # noqa: F401
                     rank, shutdown, size)
from sdp.common.errors import AlreadyInitializedError, NotInitializedError, PeerLostError  # noqa: F401
from sdp.common.reduce_ops import (Adasum, Average, Max, Min, Product, ReduceOp, Sum,  # noqa: F401
                                   resolve_op as _resolve_op)
from sdp.tensorflow import ops as _ops
from sdp.tensorflow.compression import Compression  # noqa: F401
from sdp.tensorflow.functions import broadcast_variables  # noqa: F401
from sdp.tensorflow.gradient_tape import DistributedGradientTape, check_devices as _check_devices  # noqa: F401


def init(*args, **kwargs):
    """Initialize sdp.  Mirrors ``smdistributed.dataparallel.tensorflow.init``: raises
    ``AlreadyInitializedError`` ("init() called more than once...") on a second call.
    Horovod's optional arguments (``comm``, ``process_sets``) are accepted and ignored."""
    _api.init()


def allreduce(tensor, param_index=0, num_params=1, compression=Compression.none, op=None, *,
              average=None, device_dense="", device_sparse="", prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=None, ignore_name_scope=False):
    """Allreduce ``tensor`` (``tf.Tensor``, any shape/dtype) over all ranks; same shape/dtype out.

    Mirrors ``smdistributed.dataparallel.tensorflow.allreduce(tensor, param_index, num_params,
    compression, op)`` positionally and accepts ``horovod.tensorflow.allreduce``'s keywords
    (``average``, ``prescale_factor``, ``postscale_factor``, ``name``).  ``op`` defaults to
    AVERAGE.  Raises ``TensorMismatchError`` on every rank if ranks disagree on shape/dtype/op."""
    _check_devices(device_dense, device_sparse)
    op = _resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    name = _ops._base_name("allreduce", tensor, name)
    out = _ops.allreduce_tensor(compressed, name, op, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def oob_allreduce(tensor, compression=Compression.none, op=ReduceOp.AVERAGE):
    """Out-of-band allreduce for non-gradient tensors (e.g. a loss to report).  Mirrors
    ``smdistributed.dataparallel.tensorflow.oob_allreduce``; in sdp it is the same engine path."""
    return allreduce(tensor, compression=compression, op=op)


def broadcast(tensor, root_rank, name=None, process_set=None, ignore_name_scope=False):
    """Return ``root_rank``'s ``tensor`` on every rank.  Mirrors
    ``smdistributed.dataparallel.tensorflow.broadcast`` / ``horovod.tensorflow.broadcast``.
    A ``root_rank`` outside [0, size) raises ``TensorMismatchError`` on every rank."""
    name = _ops._base_name("broadcast", tensor, name)
    return _ops.grouped_broadcast_tensors([tensor], [name], int(root_rank))[0]


def allgather(tensor, name=None, process_set=None, ignore_name_scope=False):
    """Concatenate every rank's ``tensor`` along the first dimension (which may differ per rank).
    Mirrors ``horovod.tensorflow.allgather``."""
    return _ops.allgather_tensor(tensor, _ops._base_name("allgather", tensor, name))
