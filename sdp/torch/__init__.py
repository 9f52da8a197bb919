"""The PyTorch face of sdp: ``horovod.torch``'s API on sdp's engine.

Change ``import horovod.torch as hvd`` to ``import sdp.torch as hvd`` (or run the script
unmodified with ``sdprun --compat horovod``, where ``horovod.torch`` and its submodules
``mpi_ops``, ``functions``, ``compression``, ``optimizer``, ``sync_batch_norm``, ``elastic`` are
this package's).  Names, arguments and defaults are Horovod's:

- basics: ``init`` (a second call is a no-op, as in Horovod), ``shutdown``, ``is_initialized``,
  ``size``/``rank``/``local_size``/``local_rank``/``cross_size``/``cross_rank``, ``is_homogeneous``,
  ``start_timeline``/``stop_timeline``, the build queries, process sets (``ProcessSet``,
  ``global_process_set``, ``add_process_set``, ``remove_process_set``, ``init(process_sets=...)``);
- collectives on tensors (CPU or CUDA; results on the input's device), with autograd and int
  handles: ``sdp.torch.mpi_ops``;
- ``DistributedOptimizer`` (``sdp.torch.optimizer``), ``broadcast_parameters``,
  ``broadcast_optimizer_state``, ``broadcast_object``, ``allgather_object``
  (``sdp.torch.functions``), ``SyncBatchNorm`` (``sdp.torch.sync_batch_norm``),
  ``Compression`` (``sdp.torch.compression``), ``elastic`` (``sdp.torch.elastic``).

Tensors reach the engine through ``sdp.torch.tensors`` (CPU tensors as numpy views, CUDA
tensors through the device path, no copies).  Errors: collectives whose ranks disagree raise
``TensorMismatchError`` on every rank, a lost peer ``PeerLostError``; both are
``HorovodInternalError`` (a ``RuntimeError``), as Horovod's ``synchronize`` raises.  ``op=Adasum``
is sdp's engine's (``sdp.engine.adasum``); ``DistributedOptimizer(op=Adasum)`` is Horovod's
Adasum optimizer.
"""
from sdp.common.errors import PeerLostError, SdpError, TensorMismatchError  # noqa: F401
from sdp.torch.compression import Compression  # noqa: F401
from sdp.torch.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,  # noqa: F401
                                 broadcast_parameters)
from sdp.torch.mpi_ops import (Adasum, Average, HorovodInternalError, Max, Min, Product, ProcessSet,  # noqa: F401
                               ReduceOp, Sum, add_process_set, allgather, allgather_async, allreduce, allreduce_,
                               allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier, broadcast,
                               broadcast_, broadcast_async, broadcast_async_, ccl_built, cross_rank, cross_size,
                               cuda_built, ddl_built, gloo_built, gloo_enabled, global_process_set,
                               grouped_allgather, grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                               grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
                               grouped_reducescatter_async, init, is_homogeneous, is_initialized, join,
                               local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                               poll, rank, reducescatter, reducescatter_async, remove_process_set, rocm_built,
                               shutdown, size, sparse_allreduce_async, start_timeline, stop_timeline,
                               synchronize)
from sdp.torch.optimizer import DistributedOptimizer  # noqa: F401
from sdp.torch.sync_batch_norm import SyncBatchNorm  # noqa: F401
from sdp.torch import elastic, tensors  # noqa: F401,E402

__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size", "cross_size",
    "rank", "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast",
    "broadcast_async", "broadcast_", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier", "poll",
    "synchronize", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "Average", "Sum",
    "Adasum", "Min", "Max", "Product", "HorovodInternalError", "DistributedOptimizer", "SyncBatchNorm",
    "Compression", "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "elastic",
]
