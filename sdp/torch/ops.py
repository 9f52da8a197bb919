"""The collectives of ``horovod.torch`` on torch tensors, without autograd: submissions to
``sdp.api`` and Horovod's integer handles.

Every ``*_async`` function here submits to the engine and returns an ``int`` handle (as Horovod's
do); ``poll`` says whether it completed, ``synchronize`` waits and returns its output
(a tensor on the input's device; the caller's own tensor for the in-place ``*_async_`` forms; a
tuple for grouped handles; ``(output, received_splits)`` for alltoall).  Errors (ranks that
disagree, a lost peer) are raised by ``synchronize`` on every rank, as sdp's classes, which
derive from ``HorovodInternalError`` (``sdp.common.errors.SdpError``) as Horovod's are;
bad arguments (an unsupported dtype, a rank outside the process set) raise ``ValueError`` at
submission.  ``allreduce_now`` & co. are the synchronous forms (the fast lane runs small ones
whole in the caller).  The autograd layer over these is ``sdp.torch.mpi_ops``.
"""
import itertools
from typing import Callable, List, Optional

import numpy as np
import torch

from sdp import api
from sdp.common.reduce_ops import ReduceOp, resolve_op
from sdp.process_sets import global_process_set
from sdp.torch import tensors as _t

_handles = {}  # int handle -> _Pending
_ids = itertools.count(1)


class _Pending:
    """What an int handle stands for: the engine's handles, the inputs kept alive until done, and
    how the results become the output."""

    __slots__ = ("waits", "finish", "keep")

    def __init__(self, waits: list, finish: Callable, keep):
        self.waits, self.finish, self.keep = waits, finish, keep


def _register(waits: list, finish: Callable, keep=None) -> int:
    handle = next(_ids)
    _handles[handle] = _Pending(waits, finish, keep)
    return handle


def clear() -> None:
    """Forget every pending handle (``init()``/``shutdown()``, as Horovod resets its map)."""
    _handles.clear()


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` completed (``synchronize`` will not block).
    Mirrors ``horovod.torch.poll``; ``ValueError`` for an unknown handle."""
    pending = _handles.get(handle)
    if pending is None:
        raise ValueError(f"poll: unknown handle {handle!r} (already synchronized?)")
    return all(h.done() for h in pending.waits)


def synchronize(handle: int):
    """Wait for ``handle`` and return its output (see the module docstring); None for a handle
    that is not pending (as Horovod).  Mirrors ``horovod.torch.synchronize``; raises the
    operation's error (``HorovodInternalError`` and its subclasses) on every rank."""
    pending = _handles.pop(handle, None)
    if pending is None:
        return None
    return pending.finish([h.wait() for h in pending.waits])


def _op(op) -> ReduceOp:
    return op if type(op) is ReduceOp else resolve_op(op)


def _set(process_set):
    """``process_set`` as ``sdp.api`` takes it fastest: 0 for the global set (its object costs
    ``sdp.api`` a lookup of its id per call)."""
    return 0 if process_set is global_process_set else process_set


def _device(tensor: torch.Tensor) -> Optional[torch.device]:
    return tensor.device if tensor.is_cuda else None


def _new(tensor: torch.Tensor) -> Callable:
    """The finisher of an out-of-place collective of ``tensor``: its result as a tensor."""
    device = _device(tensor)
    return lambda results: _t.as_tensor(results[0], device)


def _into(tensor: torch.Tensor) -> Callable:
    """The finisher of an in-place collective: the result written into ``tensor``, returned."""
    return lambda results: _t.copy_into(tensor, results[0])


# ---------------------------------------------------------------- allreduce
def allreduce_async(tensor: torch.Tensor, name: Optional[str] = None, op=None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set=global_process_set, inplace: bool = False) -> int:
    """Submit an allreduce of ``tensor`` (``inplace``: into ``tensor`` itself); an int handle."""
    op = _op(op)
    arr = _t.as_input(tensor, "allreduce")
    out = _t.in_place(tensor, arr) if inplace else None
    h = api.allreduce_async(arr, name, op, prescale_factor, postscale_factor, out, _set(process_set))
    return _register([h], _into(tensor) if inplace else _new(tensor), (tensor, arr))


def allreduce_now(tensor: torch.Tensor, name: Optional[str] = None, op=None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, process_set=global_process_set,
                  inplace: bool = False) -> torch.Tensor:
    """``allreduce_async`` waited at once (small host tensors may take the fast lane whole)."""
    if not inplace and tensor.dtype in _t.NUMPY_VIEWS and not tensor.requires_grad and tensor.is_cpu \
            and tensor.is_contiguous() and not tensor.is_neg():  # (the common case: a view in, a view out)
        result = api.allreduce(tensor.numpy(), name, op if type(op) is ReduceOp else resolve_op(op),
                               prescale_factor, postscale_factor, None,
                               0 if process_set is global_process_set else process_set)
        return torch.from_numpy(result) if result.flags.writeable else _t.as_tensor(result)
    arr = _t.as_input(tensor, "allreduce")
    out = _t.in_place(tensor, arr) if inplace else None
    result = api.allreduce(arr, name, op if type(op) is ReduceOp else resolve_op(op), prescale_factor,
                           postscale_factor, out, _set(process_set))
    if result is out is not None:  # (reduced into the tensor's own memory)
        return tensor
    return _t.copy_into(tensor, result) if inplace else _t.as_tensor(result, _device(tensor))


def _member_names(name: Optional[str], n: int) -> Optional[List[str]]:
    return None if name is None else [f"{name}.{i}" for i in range(n)]


def grouped_allreduce_async(tensors, name: Optional[str] = None, op=None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set=global_process_set,
                            inplace: bool = False) -> int:
    """Submit one grouped allreduce of ``tensors`` (fused by the engine); an int handle whose
    output is a tuple (``inplace``: the tensors themselves)."""
    tensors = list(tensors)
    op = _op(op)
    arrays = [_t.as_input(t, "grouped_allreduce") for t in tensors]
    hs = api.grouped_allreduce_async(arrays, _member_names(name, len(arrays)), op, prescale_factor,
                                     postscale_factor, _set(process_set)) if arrays else []
    if inplace:
        finish = lambda results: tuple(_t.copy_into(t, r) for t, r in zip(tensors, results))  # noqa: E731
    else:
        finish = lambda results: tuple(_t.as_tensor(r, _device(t)) for t, r in zip(tensors, results))  # noqa: E731
    return _register(list(hs), finish, (tensors, arrays))


def grouped_allreduce_now(tensors, name: Optional[str] = None, op=None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, process_set=global_process_set,
                          inplace: bool = False) -> list:
    """``grouped_allreduce_async`` waited at once (a list)."""
    tensors = list(tensors)
    if not tensors:
        return []
    arrays = [_t.as_input(t, "grouped_allreduce") for t in tensors]
    results = api.grouped_allreduce(arrays, name, _op(op), prescale_factor, postscale_factor, _set(process_set))
    if inplace:
        return [_t.copy_into(t, r) for t, r in zip(tensors, results)]
    return [_t.as_tensor(r, _device(t)) for t, r in zip(tensors, results)]


# ---------------------------------------------------------------- allgather, broadcast
def allgather_async(tensor: torch.Tensor, name: Optional[str] = None, process_set=global_process_set) -> int:
    """Submit an allgather (concatenation along the first dimension, in rank order); an int handle."""
    arr = _t.as_input(tensor, "allgather")
    return _register([api.allgather_async(arr, name, process_set)], _new(tensor), (tensor, arr))


def grouped_allgather_async(tensors, name: Optional[str] = None, process_set=global_process_set) -> int:
    """Submit an allgather of each of ``tensors`` (named ``<name>.<i>``); an int handle whose
    output is a tuple."""
    tensors = list(tensors)
    arrays = [_t.as_input(t, "grouped_allgather") for t in tensors]
    base = name or api.auto_name("grouped_allgather", api.process_set_id(process_set))
    hs = [api.allgather_async(a, f"{base}.{i}", process_set) for i, a in enumerate(arrays)]
    return _register(hs, lambda results: tuple(_t.as_tensor(r, _device(t)) for t, r in zip(tensors, results)),
                     (tensors, arrays))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set=global_process_set, inplace: bool = False) -> int:
    """Submit a broadcast of ``root_rank``'s ``tensor`` (``inplace``: into ``tensor``); an int handle."""
    arr = _t.as_input(tensor, "broadcast")
    h = api.broadcast_async(arr, root_rank, name, process_set)
    return _register([h], _into(tensor) if inplace else _new(tensor), (tensor, arr))


# ---------------------------------------------------------------- alltoall, reducescatter
def _splits_list(splits) -> Optional[list]:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        splits = splits.detach().cpu().numpy()
    return [int(s) for s in np.asarray(splits).ravel()]


def alltoall_async(tensor: torch.Tensor, splits=None, name: Optional[str] = None,
                   process_set=global_process_set) -> int:
    """Submit an alltoall (``splits[j]`` rows to rank j; default an equal split); an int handle
    whose output is ``(output, received_splits)`` (int32, on the CPU)."""
    arr = _t.as_input(tensor, "alltoall")
    h = api.alltoall_async(arr, _splits_list(splits), name, process_set)
    device = _device(tensor)

    def finish(results):
        received, rsplits = results[0]
        return _t.as_tensor(received, device), torch.as_tensor(np.asarray(rsplits, np.int32))
    return _register([h], finish, (tensor, arr))


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op=ReduceOp.AVERAGE,
                        process_set=global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Submit a reducescatter (this rank's block of the first dimension of the reduction); an int handle."""
    arr = _t.as_input(tensor, "reducescatter")
    h = api.reducescatter_async(arr, name, _op(op), prescale_factor, postscale_factor, process_set)
    return _register([h], _new(tensor), (tensor, arr))


def grouped_reducescatter_async(tensors, name: Optional[str] = None, op=ReduceOp.AVERAGE,
                                process_set=global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Submit a reducescatter of each of ``tensors`` (named ``<name>.<i>``); an int handle whose
    output is a tuple."""
    tensors = list(tensors)
    op = _op(op)
    arrays = [_t.as_input(t, "grouped_reducescatter") for t in tensors]
    base = name or api.auto_name("grouped_reducescatter", api.process_set_id(process_set))
    hs = [api.reducescatter_async(a, f"{base}.{i}", op, prescale_factor, postscale_factor, process_set)
          for i, a in enumerate(arrays)]
    return _register(hs, lambda results: tuple(_t.as_tensor(r, _device(t)) for t, r in zip(tensors, results)),
                     (tensors, arrays))


# ---------------------------------------------------------------- join, barrier
def join(device: int = -1) -> int:
    """This rank has no more data: until every rank joined, it contributes zeros to the other
    ranks' allreduces.  Blocks until all joined; returns the rank that joined last.  Mirrors
    ``horovod.torch.join`` (``device`` is accepted: sdp's zeros live in host memory)."""
    return int(api.join())


def barrier(process_set=global_process_set) -> None:
    """Block until every rank of ``process_set`` arrives.  Mirrors ``horovod.torch.barrier``."""
    api.barrier(process_set)
