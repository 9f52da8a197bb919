"""Rank functions for tests/test_device.py's host DLPack producers (issue 54): a module of its own,
whose ``from_dlpack`` gives a :class:`HostProducer` back, as ``torch.from_dlpack`` gives a tensor
(sdp gives a producer's result back through its module's ``from_dlpack``)."""
import numpy as np

import sdp
from sdp.common.reduce_ops import ReduceOp


class HostProducer:
    """Host memory offered only through ``__dlpack__`` / ``__dlpack_device__`` (CPU), not a numpy
    array: as a CPU ``torch.Tensor`` or a JAX array on the CPU (issue 54)."""

    def __init__(self, arr):
        self.arr = arr

    def __dlpack__(self, **kw):
        return self.arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


def from_dlpack(obj):
    """This module's ``from_dlpack``, as ``torch.from_dlpack`` is torch's: a :class:`HostProducer`
    over ``obj``'s memory (what sdp gives back for a HostProducer's collective)."""
    return HostProducer(np.from_dlpack(obj))


def host_producers():
    """Every single-tensor collective of the numpy API on a :class:`HostProducer`: {call: [the
    result's type, its values]}."""
    r, n = sdp.rank(), sdp.size()
    x = HostProducer(np.arange(6, dtype=np.float32) * (r + 1))
    got = {
        "allreduce": sdp.allreduce(x, name="hp.allreduce", op=ReduceOp.SUM),
        "allreduce_avg": sdp.allreduce(x, name="hp.allreduce_avg"),
        "allgather": sdp.allgather(x, name="hp.allgather"),
        "broadcast": sdp.broadcast(x, 1, name="hp.broadcast"),
        "reducescatter": sdp.reducescatter(x, name="hp.reducescatter", op=ReduceOp.SUM),
        "alltoall": sdp.alltoall(x, name="hp.alltoall")[0],
    }
    assert n == 2
    return {k: [type(v).__name__, np.from_dlpack(v).tolist()] for k, v in got.items()}
