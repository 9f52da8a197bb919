"""Collectives on torch tensors: mirrors ``kungfu.torch.ops``.

``op`` is KungFu's name of a reduction: ``'sum'`` (the default), ``'min'``, ``'max'``, ``'prod'``
(``'avg'``/``'mean'`` are sdp's extensions); another raises ``ValueError``.  Tensors of any shape,
the dtypes ``sdp.torch.tensors`` carries (others raise ``TypeError``); every rank passes the
same shape and dtype in the same order, else ``TensorMismatchError`` on
every rank.
"""
import torch

import sdp.api as api
from sdp.common.reduce_ops import ReduceOp
from sdp.torch import tensors as _tensors
from sdp_kungfu_bridge import _cluster

__all__ = ['all_reduce_fn', 'inplace_all_reduce_async_op', 'inplace_all_reduce_op', 'wait_handle']

_OPS = {'sum': ReduceOp.SUM, 'min': ReduceOp.MIN, 'max': ReduceOp.MAX, 'prod': ReduceOp.PRODUCT,
        'avg': ReduceOp.AVERAGE, 'mean': ReduceOp.AVERAGE}


def _op(op) -> ReduceOp:
    key = 'sum' if op is None else str(op).lower()
    if key not in _OPS:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(_OPS)}")
    return _OPS[key]


def all_reduce_fn(x: torch.Tensor, op=None) -> torch.Tensor:
    """A new tensor of ``x``'s shape, dtype and device: ``x`` reduced over every worker."""
    _cluster.ensure()
    result = api.allreduce(_tensors.as_input(x, "all_reduce_fn"), _cluster.next_name("all_reduce"), _op(op))
    return _tensors.as_tensor(result, x.device if x.is_cuda else None)


def inplace_all_reduce_op(x: torch.Tensor, op=None) -> None:
    """Reduce ``x`` over every worker, into ``x`` itself."""
    _cluster.ensure()
    out = _tensors.out_array(x)
    result = api.allreduce(_tensors.as_input(x, "inplace_all_reduce_op") if out is None else out,
                           _cluster.next_name("all_reduce"), _op(op), out=out)
    if out is None:
        _tensors.copy_into(x, result)


class _Handle:
    __slots__ = ("tensor", "handle", "copy")

    def __init__(self, tensor, handle, copy):
        self.tensor, self.handle, self.copy = tensor, handle, copy


def inplace_all_reduce_async_op(x: torch.Tensor, name: str, op=None) -> _Handle:
    """Start reducing ``x`` into itself under ``name`` (the same on every worker); returns a
    handle for ``wait_handle``."""
    _cluster.ensure()
    out = _tensors.out_array(x)
    h = api.allreduce_async(_tensors.as_input(x, "inplace_all_reduce_async_op") if out is None else out,
                            f"kf.{name}.{_cluster.epoch()}", _op(op), out=out)
    return _Handle(x, h, out is None)


def wait_handle(handle: _Handle) -> None:
    """Wait for an ``inplace_all_reduce_async_op``; raises its error on every worker."""
    result = handle.handle.wait()
    if handle.copy:
        _tensors.copy_into(handle.tensor, result)
