"""The TensorFlow face of sdp.

Mirrors ``smdistributed.dataparallel.tensorflow`` and ``horovod.tensorflow``: change
``import horovod.tensorflow as hvd`` (or ``import smdistributed.dataparallel.tensorflow as sdp``)
to ``import sdp.tensorflow as hvd`` and the script runs on sdp.

Where the two differ positionally, SMDDP wins and Horovod's spelling is accepted as keywords:
``allreduce(tensor, param_index, num_params, compression, op)`` (a bool second argument is read as
Horovod's ``average``), ``DistributedOptimizer(optimizer, name, use_locking, device_dense,
device_sparse, compression, sparse_as_dense, op, bucket_cap_mb)`` (``backward_passes_per_step``
and Horovod's later arguments are keyword-only).

``join()`` mirrors ``horovod.tensorflow.join`` (eager only): a rank out of data calls it and
contributes zeros to the Sum/Average allreduces the other ranks still run (Average still divides by
``size()``); it blocks until every rank has joined and returns the rank that joined last, as an
int32 scalar tensor.  Other collectives that involve a joined rank raise ``TensorMismatchError``.

``init()`` follows Horovod (a second call is a no-op), as under Horovod's names
(``import horovod.tensorflow as hvd`` with ``sdprun --compat horovod`` is
``sdp.compat_horovod.tensorflow``); under SMDDP's name (``smdistributed.dataparallel.tensorflow``,
``sdp.compat_smddp``) a second call raises ``AlreadyInitializedError``, as in SMDDP.
Horovod's submodules are here too: ``util``, ``mpi_ops``, ``functions``, ``compression``,
``elastic`` (Horovod Elastic: ``hvd.elastic.run``, ``TensorFlowKerasState``, ...; see
``sdp.elastic`` and ``sdprun --host-discovery-script``).

Process sets (``ProcessSet``, ``init(process_sets=[...])``, ``add_process_set``,
``remove_process_set``, ``process_set=`` on every collective) are Horovod's; see
``sdp.process_sets``.

``op=Adasum`` is Horovod's (``sdp.engine.adasum``; ``DistributedOptimizer(op=Adasum)`` of a
``tf.compat.v1.train.Optimizer`` is Horovod's delta optimizer).

Not available: ``tf.estimator`` (removed from
TensorFlow 2.16; ``BroadcastGlobalVariablesHook`` works with
``tf.compat.v1.train.MonitoredTrainingSession``), XLA (collectives are ``tf.numpy_function`` ops;
building one under ``jit_compile=True`` raises ``XlaNotSupportedError``).
"""
from sdp import api as _api
from sdp.tensorflow import threads as _threads
from sdp.api import (cross_rank, cross_size, is_initialized, local_rank, local_size,  # noqa: F401
                     rank, shutdown, size, start_timeline, stop_timeline)
from sdp.common.errors import (AlreadyInitializedError, NotInitializedError, PeerLostError,  # noqa: F401
                               SdpError, TensorMismatchError)
from sdp.common.reduce_ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum  # noqa: F401
from sdp.tensorflow.collectives import (allgather, allreduce, alltoall, barrier, broadcast,  # noqa: F401
                                        grouped_allgather, grouped_allreduce, grouped_reducescatter, join,
                                        local_rank_op, local_size_op, oob_allreduce, overlap,
                                        process_set_included_op, rank_op, reducescatter, size_op)
from sdp.tensorflow.compression import Compression  # noqa: F401
from sdp.tensorflow.functions import (allgather_object, broadcast_, broadcast_global_variables,  # noqa: F401
                                      broadcast_object, broadcast_object_fn, broadcast_variables)
from sdp.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape  # noqa: F401
from sdp.process_sets import ProcessSet, add_process_set, init_process_sets as _init_process_sets  # noqa: F401
from sdp.process_sets import remove_process_set  # noqa: F401
from sdp.tensorflow.gradients import global_process_set  # noqa: F401
from sdp.tensorflow.hooks import BroadcastGlobalVariablesHook  # noqa: F401
from sdp.tensorflow.ops import XlaNotSupportedError  # noqa: F401
from sdp.tensorflow.optimizer import DistributedOptimizer  # noqa: F401
from sdp.tensorflow.sync_batch_norm import SyncBatchNormalization  # noqa: F401
from sdp.tensorflow import elastic  # noqa: F401,E402  (hvd.elastic.run, as Horovod's package has it)


def init(comm=None, process_sets=None):
    """Initialize sdp: read the topology, meet the other ranks, start the engine; do nothing if
    it already is.

    Mirrors ``horovod.tensorflow.init``: a second call on an initialized process returns at once
    (after ``shutdown`` it initializes again).  ``comm``: None or ``[]`` (all ranks; anything
    else raises ``NotImplementedError``, sdp has no MPI; checked on every call).
    ``process_sets``: a list of ``ProcessSet`` registered as static sets (the same list on
    every rank; see ``sdp.process_sets``), or ``"dynamic"``; used by the call that
    initializes.  SMDDP's rule (a second call raises ``AlreadyInitializedError``) applies under
    SMDDP's name only: ``smdistributed.dataparallel.tensorflow.init`` (``sdp.compat_smddp``)."""
    if comm not in (None, []):
        raise NotImplementedError(f"sdp.tensorflow.init() takes no MPI communicator (got comm={comm!r})")
    if _api.is_initialized():
        return  # Horovod's rule
    _api.init()
    _threads.configure(_api.local_size())
    _init_process_sets(process_sets)


def is_homogeneous() -> bool:
    """True if every host runs the same number of ranks (``size == local_size * cross_size``).
    Mirrors ``horovod.tensorflow.is_homogeneous``."""
    return size() == local_size() * cross_size()


# Horovod's build queries: sdp has its own engine (ZeroMQ + numpy), none of these backends.
def mpi_built() -> bool:
    """False: sdp does not use MPI.  Mirrors ``horovod.tensorflow.mpi_built``."""
    return False


def mpi_enabled() -> bool:
    """False: sdp does not use MPI.  Mirrors ``horovod.tensorflow.mpi_enabled``."""
    return False


def mpi_threads_supported() -> bool:
    """False: sdp does not use MPI.  Mirrors ``horovod.tensorflow.mpi_threads_supported``."""
    return False


def gloo_built() -> bool:
    """False: sdp does not use Gloo.  Mirrors ``horovod.tensorflow.gloo_built``."""
    return False


def gloo_enabled() -> bool:
    """False: sdp does not use Gloo.  Mirrors ``horovod.tensorflow.gloo_enabled``."""
    return False


def nccl_built() -> int:
    """0: sdp does not use NCCL.  Mirrors ``horovod.tensorflow.nccl_built`` (which returns the
    NCCL version, 0 without NCCL)."""
    return 0


def ddl_built() -> bool:
    """False.  Mirrors ``horovod.tensorflow.ddl_built``."""
    return False


def ccl_built() -> bool:
    """False.  Mirrors ``horovod.tensorflow.ccl_built``."""
    return False


def cuda_built() -> bool:
    """True when sdp can reduce on CUDA devices: PyCUDA (the ``cuda`` extra) is installed (checked
    without importing it, so no CUDA context is made).  Mirrors ``horovod.tensorflow.cuda_built``."""
    from sdp.common.util import cuda_built as built
    return built()


def rocm_built() -> bool:
    """False.  Mirrors ``horovod.tensorflow.rocm_built``."""
    return False


__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size", "rank", "local_rank", "cross_rank", "cross_size",
    "is_homogeneous", "rank_op", "size_op", "local_rank_op", "local_size_op", "process_set_included_op",
    "allreduce", "grouped_allreduce", "oob_allreduce", "overlap", "allgather", "grouped_allgather", "broadcast",
    "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier",
    "broadcast_variables", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
    "allgather_object", "DistributedOptimizer", "DistributedGradientTape", "PartialDistributedGradientTape",
    "BroadcastGlobalVariablesHook", "SyncBatchNormalization", "Compression", "ReduceOp", "Average", "Sum",
    "Adasum", "Min", "Max", "Product", "global_process_set", "ProcessSet", "add_process_set", "remove_process_set", "XlaNotSupportedError", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
    "rocm_built",
]

# Horovod / SMDDP scripts call ``hvd.broadcast_variables(opt.variables(), root_rank=0)``; Keras 3
# made ``variables`` a list property: let both spellings work (sdp.tensorflow.keras_variables).
from sdp.tensorflow.keras_variables import patch_keras_optimizer_variables as _patch_keras_optimizer_variables  # noqa: E402,E501

_patch_keras_optimizer_variables()
