"""``smdistributed.dataparallel.torch.distributed`` on sdp: SMDDP's PyTorch functions (before
v1.4, which deprecated them for ``torch.distributed`` with ``backend="smddp"``), each on
``torch.distributed`` over sdp's backend (``sdp.torch.distributed``).

Process groups are not supported, as in SMDDP: ``group`` is ``group.WORLD`` (or None), else
``ValueError``.  ``async_op=True`` returns the collective's ``Work``, else None.  Mirrors
``smdistributed.dataparallel.torch.distributed`` (SMDDP v1.2/v1.3).
"""
import torch.distributed as _dist

import sdp.api as _api
from sdp.common import topology as _topology
from sdp.torch import distributed as _backend

group = _dist.group
"""``torch.distributed.group`` itself: ``group.WORLD`` is the default process group, the
default and the only group this module's functions take (as SMDDP's ``group=group.WORLD``; any
other group raises ``ValueError``)."""


class ReduceOp:
    """SMDDP's reduction operations: ``AVERAGE``, ``SUM``, ``MIN``, ``MAX``."""
    AVERAGE = _dist.ReduceOp.AVG
    SUM = _dist.ReduceOp.SUM
    MIN = _dist.ReduceOp.MIN
    MAX = _dist.ReduceOp.MAX


def _world(group, what: str):
    if group is None or group is _dist.group.WORLD or group is _dist.GroupMember.WORLD:
        return None
    raise ValueError(f"{what}: process groups are not supported in smdistributed.dataparallel; "
                     f"the only group is group.WORLD, got {group!r}")


def is_available() -> bool:
    """True when this process was started as a rank of a distributed job (a launcher's
    environment that sdp reads: ``sdprun``, ``mpirun``, Slurm, ...), False for a plain local run."""
    return _topology.from_env().source != "default"


def init_process_group(*args, **kwargs) -> None:
    """Start sdp and ``torch.distributed``'s default process group on sdp's backend.  Arguments
    are accepted for parity with ``torch.distributed`` and ignored (SMDDP's rule).  Called when
    the default group exists already, raises ``ValueError`` (PyTorch's)."""
    _dist.init_process_group(backend=_backend.BACKEND)


def is_initialized() -> bool:
    """Whether the default process group has been initialized."""
    return _dist.is_initialized()


def get_world_size(group=group.WORLD) -> int:
    """The number of ranks in the job."""
    _world(group, "get_world_size")
    return _dist.get_world_size()


def get_rank(group=group.WORLD) -> int:
    """This process's rank in the job, 0 .. world size - 1."""
    _world(group, "get_rank")
    return _dist.get_rank()


def get_local_rank() -> int:
    """This process's rank among the ranks on its host (the GPU it should pin)."""
    return _api.local_rank()


def all_reduce(tensor, op=ReduceOp.SUM, group=group.WORLD, async_op=False):
    """Reduce ``tensor`` in place across every rank (``ReduceOp.SUM`` by default; AVERAGE, MIN,
    MAX).  Returns the ``Work`` when ``async_op``, else None."""
    return _dist.all_reduce(tensor, op=ReduceOp.SUM if op is None else op, group=_world(group, "all_reduce"),
                            async_op=async_op)


def broadcast(tensor, src=0, group=group.WORLD, async_op=False):
    """Overwrite ``tensor`` with rank ``src``'s on every rank."""
    return _dist.broadcast(tensor, src, group=_world(group, "broadcast"), async_op=async_op)


def all_gather(tensor_list, tensor, group=group.WORLD, async_op=False):
    """Fill ``tensor_list`` (one tensor of ``tensor``'s size per rank) with every rank's ``tensor``."""
    return _dist.all_gather(tensor_list, tensor, group=_world(group, "all_gather"), async_op=async_op)


def all_to_all_single(output_t, input_t, output_split_sizes=None, input_split_sizes=None, group=group.WORLD,
                      async_op=False):
    """Scatter ``input_t``'s rows (``input_split_sizes`` to each rank, equal parts by default) and
    gather what every rank sent here into ``output_t``."""
    return _dist.all_to_all_single(output_t, input_t, output_split_sizes, input_split_sizes,
                                   group=_world(group, "all_to_all_single"), async_op=async_op)


def barrier(group=group.WORLD, async_op=False):
    """Block until every rank reaches the barrier (or return its ``Work`` when ``async_op``)."""
    return _dist.barrier(group=_world(group, "barrier"), async_op=async_op)
