"""sdp: distributed data-parallel training for TensorFlow 2 over ZeroMQ.

``import sdp.tensorflow as hvd`` for the Horovod / SageMaker API; ``sdp`` itself exposes the
framework-free numpy API (:mod:`sdp.api`).
"""
from sdp.api import (allgather, allgather_async, allgather_object, allreduce, allreduce_async,  # noqa: F401
                     alltoall, barrier, broadcast, broadcast_async, broadcast_object, cross_rank,
                     cross_size, device_counters, grouped_allgather, grouped_allreduce, grouped_allreduce_async,
                     grouped_broadcast_async, init, is_initialized, join,
                     local_rank, local_size, rank, recv, reducescatter, send, shutdown, size, start_timeline,
                     stop_timeline)
from sdp.common import errors  # noqa: F401
from sdp.common import rank_signals as _rank_signals
from sdp.common.errors import TensorMismatchError  # noqa: F401
from sdp.common.reduce_ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum  # noqa: F401

__version__ = "0.1.0"

_rank_signals.install_from_env()  # under sdprun: quiet Ctrl-C / SIGTERM, stacks on SIGUSR1
