"""The names of ``horovod.tensorflow.mpi_ops``, on sdp's engine (no MPI involved).

Under ``sdprun --compat horovod`` the module ``horovod.tensorflow.mpi_ops`` is this one.  It holds
Horovod's *low-level* ops and their conventions, which differ from the top-level functions:

- ``_allreduce``, ``_grouped_allreduce``, ``_reducescatter``, ``_grouped_reducescatter`` default
  to ``op=Sum`` (the top-level ``allreduce``/``reducescatter`` default to Average) and take no
  compression.  ``allgather``, ``grouped_allgather``, ``broadcast``, ``broadcast_``,
  ``alltoall``, ``join``, ``barrier``, ``size_op``, ``rank_op``, ``local_size_op``,
  ``local_rank_op``, ``process_set_included_op`` are ``sdp.tensorflow``'s.
- ``init()`` is ``sdp.tensorflow.init``, which follows Horovod: calling it again while
  initialized is a no-op (SMDDP's, ``smdistributed.dataparallel.tensorflow.init``, raises
  ``AlreadyInitializedError``).  After ``shutdown()`` it initializes again.
- ``handle_average_backwards_compatibility(op, average)``, ``check_num_rank_power_of_2(n)``,
  ``_normalize_name(name)`` (every character outside ``[a-zA-Z0-9_]`` becomes ``_``),
  ``_executing_eagerly()``; the reduce ops ``Average, Sum, Adasum, Min, Max, Product`` (sdp's
  ``ReduceOp``, with Horovod's numeric values); the basics ``size``,
  ``rank``, ``local_size``, ``local_rank``, ``cross_size``, ``cross_rank``, ``is_initialized``,
  ``shutdown``, ``start_timeline``, ``stop_timeline``, ``is_homogeneous`` and the build queries
  (``mpi_built`` ... ``rocm_built``); ``global_process_set``.
- Process sets: ``ProcessSet``, ``add_process_set``, ``remove_process_set``,
  ``global_process_set`` (``sdp.process_sets``); ``init(process_sets=[...] or "dynamic")``
  registers static sets (every rank passes the same list).  ``MPI_LIB`` (Horovod's compiled op
  library) does not exist in sdp.
"""
import re

from sdp.common import reduce_ops as _reduce_ops
from sdp.common.reduce_ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401
from sdp.common.util import get_average_backwards_compatibility_fun, num_rank_is_power_2
from sdp.process_sets import ProcessSet, add_process_set, remove_process_set  # noqa: F401
from sdp.tensorflow import (allgather, alltoall, barrier, broadcast, broadcast_, ccl_built,  # noqa: F401
                            cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,
                            global_process_set, grouped_allgather, grouped_allreduce, grouped_reducescatter,
                            is_homogeneous, is_initialized, join, local_rank, local_rank_op, local_size,
                            local_size_op, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                            process_set_included_op, rank, rank_op, reducescatter, rocm_built, shutdown, size,
                            size_op, start_timeline, stop_timeline)
from sdp.tensorflow import allreduce as _allreduce_top
from sdp.tensorflow import init  # noqa: F401  (Horovod's: a second call is a no-op)
from sdp.tensorflow.util import _executing_eagerly  # noqa: F401

handle_average_backwards_compatibility = get_average_backwards_compatibility_fun(_reduce_ops)
check_num_rank_power_of_2 = num_rank_is_power_2


def _normalize_name(name: str) -> str:
    """``name`` with every character outside ``[a-zA-Z0-9_]`` replaced by ``_`` (TensorFlow's
    op-name rules).  Mirrors ``horovod.tensorflow.mpi_ops._normalize_name``."""
    return re.sub("[^a-zA-Z0-9_]", "_", name)


def _check_has_gpu() -> bool:
    """False: sdp's TensorFlow face reduces on the CPU."""
    return False


def _allreduce(tensor, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0, ignore_name_scope=False,
               process_set=global_process_set):
    """Reduce ``tensor`` over all ranks (default: Sum); same shape and dtype back.  Mirrors
    ``horovod.tensorflow.mpi_ops._allreduce``."""
    return _allreduce_top(tensor, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                          name=name, ignore_name_scope=ignore_name_scope, process_set=process_set)


def _grouped_allreduce(tensors, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
                       ignore_name_scope=False, process_set=global_process_set):
    """Reduce each tensor of ``tensors`` (default: Sum) in one fused op; a list back.  Mirrors
    ``horovod.tensorflow.mpi_ops._grouped_allreduce``."""
    return grouped_allreduce(tensors, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             ignore_name_scope=ignore_name_scope, process_set=process_set, name=name)


def _reducescatter(tensor, name=None, op=Sum, ignore_name_scope=False, process_set=global_process_set):
    """Reduce ``tensor`` (default: Sum) and return this rank's block of the first dimension.
    Mirrors ``horovod.tensorflow.mpi_ops._reducescatter``."""
    return reducescatter(tensor, op=op, name=name, ignore_name_scope=ignore_name_scope, process_set=process_set)


def _grouped_reducescatter(tensors, name=None, op=Sum, ignore_name_scope=False, process_set=global_process_set):
    """``_reducescatter`` of each tensor of ``tensors``.  Mirrors
    ``horovod.tensorflow.mpi_ops._grouped_reducescatter``."""
    return grouped_reducescatter(tensors, op=op, process_set=process_set)


