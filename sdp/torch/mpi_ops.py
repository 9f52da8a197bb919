"""``horovod.torch.mpi_ops`` on sdp's engine: Horovod's PyTorch collectives, their handles and
their gradients (no MPI involved; under ``sdprun --compat horovod`` this module is
``horovod.torch.mpi_ops``).

Tensors: CPU tensors go to the engine as numpy views of their memory, CUDA tensors through its
device path (the caller's current stream is waited on), results come back on the input's device
without copies (``sdp.torch.tensors``).  Every dtype sdp carries: bool, uint8, int8-int64,
float16, bfloat16, float32, float64 (others: ``ValueError``, as Horovod's "Tensor type ... is not
supported").  Names key a collective across ranks; without one, a per-kind counter names it (the
same on every rank that makes the same calls in the same order).

Functions (Horovod's names, arguments and defaults):

- ``allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
  prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set)`` -> a new tensor
  (default op: Average); ``allreduce_`` (in place: returns the caller's tensor);
  ``allreduce_async`` / ``allreduce_async_`` -> an int handle; ``grouped_allreduce(_)(_async)``
  of a list (one fused submission).  ``op``: ``Average``, ``Sum``, ``Min``, ``Max``, ``Product``,
  ``Adasum`` (float tensors, a power-of-two number of ranks: see ``sdp.api``); ``average`` is
  Horovod's deprecated spelling.
- ``allgather(tensor, name=None, process_set=...)`` (first dimensions may differ), ``_async``,
  ``grouped_allgather(_async)``; ``broadcast(tensor, root_rank, ...)``, ``broadcast_`` (in
  place), ``broadcast_async(_)``; ``alltoall(tensor, splits=None, ...)`` -> the received tensor,
  or ``(received, received_splits)`` when ``splits`` is given; ``alltoall_async``;
  ``reducescatter(tensor, name=None, compression=..., op=Average, process_set=...,
  prescale_factor=1.0, postscale_factor=1.0)`` -> this rank's block of the first dimension
  (lower ranks get the extra rows), ``_async``, ``grouped_reducescatter(_async)``.
- ``poll(handle)``, ``synchronize(handle)``, ``join(device=-1)`` -> the rank that joined last,
  ``barrier(process_set=...)``; ``sparse_allreduce_async(tensor, name, op)`` (a sparse COO
  tensor as two allgathers; the handle is a callable, as Horovod's).
- Basics: ``init(comm=None, process_sets=None)`` (a second call is a no-op, as in Horovod),
  ``shutdown``, ``is_initialized``, ``size``/``rank``/``local_*``/``cross_*``,
  ``is_homogeneous``, ``start_timeline``/``stop_timeline``, the build queries (``mpi_built``...:
  sdp has no MPI, Gloo or NCCL), ``ProcessSet``/``global_process_set``/``add_process_set``/
  ``remove_process_set`` (``sdp.process_sets``), ``HorovodInternalError``.

Gradients (``torch.autograd.Function``s, as Horovod's ``mpi_ops.py`` defines them): allreduce's
is an allreduce of the gradient with the same op and scale factors; allgather's is an Average
allreduce of the gradient, sliced to this rank's rows; broadcast's is an Average allreduce, zero
on ranks other than the root; alltoall's is an alltoall back with the received splits;
reducescatter's is an allgather of the gradient (times the set's size for Sum, times the scale
factors).  Tensors that do not require a gradient skip the autograd layer.

Errors: ranks that disagree on a collective (shape, dtype, op, root...) get
``TensorMismatchError`` on every rank, a lost peer
``PeerLostError``: both are ``HorovodInternalError`` (a
``RuntimeError``), the class Horovod's ``synchronize`` raises.
"""
import torch
from torch import from_numpy as _from_numpy

from sdp import api as _api
from sdp.common import reduce_ops as _reduce_ops
from sdp.common.errors import HorovodInternalError  # noqa: F401
from sdp.common.reduce_ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum  # noqa: F401
from sdp.common.util import ccl_built, cuda_built, ddl_built, gloo_built, mpi_built, nccl_built  # noqa: F401
from sdp.common.util import get_average_backwards_compatibility_fun as _average_compat
from sdp.common.util import num_rank_is_power_2 as _power_of_2
from sdp.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set  # noqa: F401
from sdp.process_sets import init_process_sets as _init_process_sets
from sdp.process_sets import set_size as _set_size
from sdp.torch import ops as _ops
from sdp.torch.compression import Compression
from sdp.torch.compression import NoneCompressor as _NoneCompressor
from sdp.torch.tensors import as_tensor as _as_tensor
from sdp.torch.ops import (allgather_async, alltoall_async, barrier, join, poll, synchronize)  # noqa: F401
from sdp.api import (cross_rank, cross_size, is_initialized, local_rank, local_size, rank, size,  # noqa: F401
                     start_timeline, stop_timeline)

handle_average_backwards_compatibility = _average_compat(_reduce_ops)
"""``handle_average_backwards_compatibility(op, average)`` -> the ``ReduceOp`` to run, from
Horovod's legacy ``average=`` argument: ``op`` when given (``ValueError`` when ``average`` is
given too), else ``Average`` for ``average=True`` and ``Sum`` for ``average=False`` (with a
``DeprecationWarning``), else ``Average``.  Mirrors
``horovod.torch.mpi_ops.handle_average_backwards_compatibility``."""
check_num_rank_power_of_2 = _power_of_2
"""``check_num_rank_power_of_2(num_rank)`` -> bool: True if ``num_rank`` (an int, a number of
ranks) is a power of two (1, 2, 4, ...; 0 is not), the condition of ``op=Adasum``.  Mirrors
``horovod.torch.mpi_ops.check_num_rank_power_of_2``."""


def init(comm=None, process_sets=None) -> None:
    """Initialize sdp, or do nothing if it already is (Horovod's rule).  ``comm``: None or ``[]``
    (anything else raises ``NotImplementedError``: sdp has no MPI).  ``process_sets``: a list of
    ``ProcessSet`` registered as static sets (the same list on every rank), or
    ``"dynamic"``.  Mirrors ``horovod.torch.init``; raises what ``sdp.api.init`` raises."""
    if comm not in (None, []):
        raise NotImplementedError(f"init(comm={comm!r}): sdp does not use MPI; pass no communicator")
    if _api.is_initialized():
        return
    _ops.clear()
    _api.init()
    _init_process_sets(process_sets)


def shutdown() -> None:
    """Stop sdp in this process (pending handles are forgotten).  Mirrors ``horovod.torch.shutdown``."""
    _ops.clear()
    _api.shutdown()


def is_homogeneous() -> bool:
    """True if every host runs the same number of ranks.  Mirrors ``horovod.torch.is_homogeneous``."""
    return size() == local_size() * cross_size()


def mpi_enabled() -> bool:
    """False: sdp does not use MPI.  Mirrors ``horovod.torch.mpi_enabled``."""
    return False


mpi_threads_supported = mpi_enabled
"""``mpi_threads_supported()`` -> False: sdp does not use MPI, so there is no MPI
multi-threading to mix with ``mpi4py``.  Mirrors
``horovod.torch.mpi_threads_supported``."""
gloo_enabled = mpi_enabled
"""``gloo_enabled()`` -> False: sdp runs on its own engine, not Gloo.  Mirrors
``horovod.torch.gloo_enabled``."""
rocm_built = mpi_enabled
"""``rocm_built()`` -> False: sdp's device path is CUDA only (no ROCm).  Mirrors
``horovod.torch.rocm_built``."""


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ---------------------------------------------------------------- allreduce
def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> int:
    """Start an allreduce of ``tensor`` (not modified) and return an int handle for
    ``synchronize`` (a new tensor).  Mirrors ``horovod.torch.allreduce_async``."""
    op = handle_average_backwards_compatibility(op, average)
    return _ops.allreduce_async(tensor, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> int:
    """Start an in-place allreduce of ``tensor``; ``synchronize`` returns ``tensor``.
    Mirrors ``horovod.torch.allreduce_async_``."""
    op = handle_average_backwards_compatibility(op, average)
    return _ops.allreduce_async(tensor, name, op, prescale_factor, postscale_factor, process_set, inplace=True)


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce with Horovod's gradient: the gradient allreduced with the same op and scales."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return _ops.allreduce_now(tensor, name, op, prescale_factor, postscale_factor, process_set)

    @staticmethod
    def backward(ctx, grad_output):
        op, pre, post, ps = ctx.args
        return _ops.allreduce_now(grad_output, None, op, pre, post, ps), None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` over the ranks of ``process_set`` (default: Average) and return a new
    tensor of its shape, dtype and device; differentiable.  Mirrors ``horovod.torch.allreduce``."""
    if average is not None or op is None:
        op = handle_average_backwards_compatibility(op, average)
    if compression is _NoneCompressor:  # (the default: no calls)
        if tensor.requires_grad:
            if torch.is_grad_enabled():
                return HorovodAllreduce.apply(tensor, name, op, prescale_factor, postscale_factor, process_set)
        elif name is not None and process_set is global_process_set and prescale_factor == 1.0 \
                and type(op) is ReduceOp and op is not Adasum and tensor.is_cpu:
            front = _api.allreduce_front()  # (the common case whole in C: a learnt name, a view in and out)
            if front is not None:
                try:
                    view = tensor.numpy()  # (its own memory; bfloat16 and negative-bit views raise)
                except (TypeError, RuntimeError):
                    view = None
                result = None if view is None else front(name, view, op, postscale_factor, None)
                if result is not None:  # (else not learnt, strided, another dtype, the lane busy...)
                    return _from_numpy(result) if result.flags.writeable else _as_tensor(result)
        return _ops.allreduce_now(tensor, name, op, prescale_factor, postscale_factor, process_set)
    compressed, ctx = compression.compress(tensor)
    if _needs_grad(compressed):
        out = HorovodAllreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    else:
        out = _ops.allreduce_now(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Reduce ``tensor`` in place and return it (the caller's own tensor).  Mirrors
    ``horovod.torch.allreduce_``."""
    if average is not None or op is None:
        op = handle_average_backwards_compatibility(op, average)
    return _ops.allreduce_now(tensor, name, op, prescale_factor, postscale_factor, process_set, inplace=True)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set) -> int:
    """Start one fused allreduce of a list of tensors; ``synchronize`` returns a tuple of new
    tensors.  Mirrors ``horovod.torch.grouped_allreduce_async``."""
    op = handle_average_backwards_compatibility(op, average)
    return _ops.grouped_allreduce_async(tensors, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    """In-place ``grouped_allreduce_async``: ``synchronize`` returns the tensors
    themselves.  Mirrors ``horovod.torch.grouped_allreduce_async_``."""
    op = handle_average_backwards_compatibility(op, average)
    return _ops.grouped_allreduce_async(tensors, name, op, prescale_factor, postscale_factor, process_set,
                                        inplace=True)


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Grouped allreduce with Horovod's gradient: the gradients grouped-allreduced alike."""

    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return tuple(_ops.grouped_allreduce_now(tensors, name, op, prescale_factor, postscale_factor, process_set))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps = ctx.args
        return (None, None, None, None, None, *_ops.grouped_allreduce_now(grads, None, op, pre, post, ps))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set) -> list:
    """Reduce each tensor of a list (one fused submission) and return new tensors; differentiable.
    Mirrors ``horovod.torch.grouped_allreduce``."""
    op = handle_average_backwards_compatibility(op, average)
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    if _needs_grad(*compressed):
        out = HorovodGroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set, *compressed)
    else:
        out = _ops.grouped_allreduce_now(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return [compression.decompress(t, c) for t, c in zip(out, ctxs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set) -> list:
    """Reduce each tensor of a list in place; returns them.  Mirrors ``horovod.torch.grouped_allreduce_``."""
    op = handle_average_backwards_compatibility(op, average)
    return _ops.grouped_allreduce_now(tensors, name, op, prescale_factor, postscale_factor, process_set,
                                      inplace=True)


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Start the allreduce of a sparse COO ``tensor`` as allgathers of its indices and values
    (Average divides the values by the set's size); returns a callable that waits and gives the
    sparse result (duplicates not coalesced).  Mirrors ``horovod.torch.sparse_allreduce_async``."""
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = _ops.allgather_async(t.indices().t().contiguous(), f"{name}.indices", process_set)
    values = _ops.allgather_async(t.values(), f"{name}.values", process_set)

    def handle():
        vals = synchronize(values)
        idx = synchronize(indices)
        if op == Average:
            vals = vals / _set_size(process_set)
        return torch.sparse_coo_tensor(idx.t(), vals, t.size())
    return handle


# ---------------------------------------------------------------- allgather
class HorovodAllgather(torch.autograd.Function):
    """Allgather with Horovod's gradient: the gradient averaged over the ranks, this rank's rows."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim, ctx.process_set = tensor.shape[0], process_set
        return synchronize(_ops.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        return _rows_of_mine(_ops.allreduce_now(grad_output, None, Average, process_set=ctx.process_set),
                             ctx.dim, ctx.process_set), None, None


def _rows_of_mine(reduced, dim: int, process_set):
    """This rank's ``dim`` rows of an allgathered tensor (every rank's row count gathered)."""
    dims = _api.allgather(torch.tensor([dim], dtype=torch.int64).numpy(), process_set=process_set)
    me = process_set.rank() if isinstance(process_set, ProcessSet) else rank()
    return reduced.narrow(0, int(dims[:me].sum()), dim)


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along the first dimension (which may differ per rank),
    in rank order; differentiable.  Mirrors ``horovod.torch.allgather``."""
    if _needs_grad(tensor):
        return HorovodAllgather.apply(tensor, name, process_set)
    return synchronize(_ops.allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """Start an allgather of each tensor of a list; ``synchronize`` returns a tuple.
    Mirrors ``horovod.torch.grouped_allgather_async``."""
    return _ops.grouped_allgather_async(tensors, name, process_set)


class HorovodGroupedAllgather(torch.autograd.Function):
    """Grouped allgather with Horovod's gradient (as ``HorovodAllgather``'s, per tensor)."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return synchronize(_ops.grouped_allgather_async(tensors, name, process_set))

    @staticmethod
    def backward(ctx, *grads):
        reduced = _ops.grouped_allreduce_now(grads, None, Average, process_set=ctx.process_set)
        return (None, None, *[_rows_of_mine(r, d, ctx.process_set) for r, d in zip(reduced, ctx.dims)])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather each tensor of a list (named ``<name>.<i>``); a tuple.  Differentiable.  Mirrors
    ``horovod.torch.grouped_allgather``."""
    if _needs_grad(*tensors):
        return HorovodGroupedAllgather.apply(name, process_set, *tensors)
    return synchronize(_ops.grouped_allgather_async(tensors, name, process_set))


# ---------------------------------------------------------------- broadcast
def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start a broadcast of ``root_rank``'s ``tensor`` (not modified); ``synchronize`` returns
    a new tensor.  Mirrors ``horovod.torch.broadcast_async``."""
    return _ops.broadcast_async(tensor, root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start an in-place broadcast into ``tensor``; ``synchronize`` returns ``tensor``.
    Mirrors ``horovod.torch.broadcast_async_``."""
    return _ops.broadcast_async(tensor, root_rank, name, process_set, inplace=True)


class HorovodBroadcast(torch.autograd.Function):
    """Broadcast with Horovod's gradient: the gradient averaged over the ranks on the root, zero elsewhere."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(_ops.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        reduced = _ops.allreduce_now(grad_output, None, Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            reduced = reduced.zero_()
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """``root_rank``'s ``tensor`` (a job rank) as a new tensor on every rank; differentiable.
    Mirrors ``horovod.torch.broadcast``."""
    if _needs_grad(tensor):
        return HorovodBroadcast.apply(tensor, root_rank, name, process_set)
    return synchronize(_ops.broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Broadcast into ``tensor`` in place and return it.  Mirrors ``horovod.torch.broadcast_``."""
    return synchronize(_ops.broadcast_async(tensor, root_rank, name, process_set, inplace=True))


# ---------------------------------------------------------------- alltoall
class HorovodAlltoall(torch.autograd.Function):
    """Alltoall with Horovod's gradient: the gradient sent back with the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(_ops.alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *_):
        back, _ = synchronize(_ops.alltoall_async(grad_output.contiguous(), ctx.received, None, ctx.process_set))
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[j]`` rows of ``tensor`` to rank j (default: an equal split of the first
    dimension) and return the rows received, in rank order; with ``splits`` given,
    ``(received, received_splits)`` (int32).  Differentiable.  Mirrors ``horovod.torch.alltoall``;
    splits that do not add up raise ``TensorMismatchError`` on every rank."""
    if _needs_grad(tensor):
        return HorovodAlltoall.apply(tensor, splits, name, process_set)
    output, received = synchronize(_ops.alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received)


# ---------------------------------------------------------------- reducescatter
def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> int:
    """Start a reducescatter; ``synchronize`` returns this rank's block.  Mirrors
    ``horovod.torch.reducescatter_async``."""
    return _ops.reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor)


def _scatter_grads(grads, op, process_set, pre, post) -> list:
    """Horovod's reducescatter gradient before the allgather: Sum scales by the set's size, then
    the pre- and postscale factors."""
    factor = (_set_size(process_set) if op == Sum else 1) * pre * post
    return [g * factor if factor != 1 else g for g in grads]


class HorovodReducescatter(torch.autograd.Function):
    """Reducescatter with Horovod's gradient: the (scaled) gradient allgathered."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return synchronize(_ops.reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        op, ps, pre, post = ctx.args
        grad = _scatter_grads([grad_output], op, ps, pre, post)[0].contiguous()
        return synchronize(_ops.allgather_async(grad, None, ps)), None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` over the ranks (default: Average) and return this rank's block of the
    first dimension (lower ranks get the extra rows); differentiable.  Mirrors
    ``horovod.torch.reducescatter``."""
    compressed, ctx = compression.compress(tensor)
    if _needs_grad(compressed):
        out = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    else:
        out = synchronize(_ops.reducescatter_async(compressed, name, op, process_set, prescale_factor,
                                                   postscale_factor))
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start a reducescatter of each tensor of a list; ``synchronize`` returns a tuple.
    Mirrors ``horovod.torch.grouped_reducescatter_async``."""
    return _ops.grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor, postscale_factor)


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Grouped reducescatter with Horovod's gradient (as ``HorovodReducescatter``'s, per tensor)."""

    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return synchronize(_ops.grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor,
                                                            postscale_factor))

    @staticmethod
    def backward(ctx, *grads):
        op, ps, pre, post = ctx.args
        grads = [g.contiguous() for g in _scatter_grads(grads, op, ps, pre, post)]
        return (None, None, None, None, None, *synchronize(_ops.grouped_allgather_async(grads, None, ps)))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0) -> list:
    """Reducescatter each tensor of a list (named ``<name>.<i>``); differentiable.  Mirrors
    ``horovod.torch.grouped_reducescatter``."""
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    if _needs_grad(*compressed):
        out = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                                *compressed)
    else:
        out = synchronize(_ops.grouped_reducescatter_async(compressed, name, op, process_set, prescale_factor,
                                                           postscale_factor))
    return [compression.decompress(t, c) for t, c in zip(out, ctxs)]
