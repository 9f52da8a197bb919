"""Collectives on ``tf.Tensor``: Horovod's and SageMaker's TensorFlow functions.

Each function builds its ops (eagerly they run at once; in ``tf.function`` / ``tf.compat.v1`` graphs
it runs when the graph does).  Shapes and dtypes must agree across ranks where stated, otherwise
every rank raises ``sdp.errors.TensorMismatchError``.  A call before ``init()`` raises
``sdp.errors.NotInitializedError``; inside ``jit_compile=True`` functions
``sdp.tensorflow.ops.XlaNotSupportedError``.
"""
import numpy as np
import tensorflow as tf

from sdp import api
from sdp.common.reduce_ops import ReduceOp, resolve_op
from sdp.tensorflow import ops
from sdp.tensorflow.compression import Compression
from sdp.process_sets import set_size
from sdp.tensorflow.gradients import ADASUM_SPARSE, check_devices, check_process_set, global_process_set


try:
    from tensorflow.python.framework.ops import EagerTensor as _EagerTensor  # (internal: else no fast path)
except ImportError:  # pragma: no cover - TensorFlow internals moved
    _EagerTensor = None


def _check_op(op, ps):
    """``op``; for Adasum, Horovod's checks as the op is built (``sdp.api.check_adasum``:
    ``NotImplementedError`` for a process set, or a number of ranks that is not a power of two)."""
    if op == ReduceOp.ADASUM:
        api.check_adasum(ps)
    return op


def _sparse_allreduce(tensor, op, prescale_factor, postscale_factor, name, process_set=0):
    if op == ReduceOp.ADASUM:
        raise NotImplementedError(ADASUM_SPARSE)
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    base = ops._base_name("allreduce", tensor.values, name)
    values, indices = ops.grouped_allgather_tensors([tensor.values, tensor.indices],
                                                    [base + ".values", base + ".indices"], process_set)
    if op == ReduceOp.AVERAGE:
        values = values / tf.cast(set_size(process_set), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)


# ---------------------------------------------------------------- gradients (Horovod's definitions)
#
# Horovod registers a gradient for every collective op (horovod/tensorflow/mpi_ops.py): allgather ->
# Average-allreduce of the incoming gradient, then this rank's rows (by every rank's first-dimension
# size, allgathered); broadcast -> Average-allreduce, kept on the root, zeros elsewhere; alltoall ->
# alltoall of the gradient with the received splits; reducescatter -> allgather of the gradient,
# times the set's size when the op is Sum.  sdp builds them with ``tf.custom_gradient``, so they hold
# eagerly, in ``tf.function`` and in ``tf.compat.v1`` graphs, for the op's process set.  Integer
# tensors have no gradient (as in TensorFlow).


def _differentiable(tensors) -> bool:
    return (all(t.dtype.is_floating or t.dtype.is_complex for t in tensors)
            and not (tf.executing_eagerly() and not ops._could_record()))


def _set_index(ps) -> int:
    """This rank's index in process set ``ps`` (its row block in an allgather)."""
    return api.process_set_ranks(ps).index(api.rank())


def _zero_if_none(dy, x):
    return tf.zeros_like(x) if dy is None else dy


def _allgather_grad(dys, xs, names, ps):
    """Horovod's allgather gradient for each of ``xs``: this rank's rows of the averaged gradient."""
    gnames = [ops.grad_name(n) for n in names]
    grads = [ops.allreduce_tensor(_zero_if_none(d, x), g, ReduceOp.AVERAGE, process_set=ps)
             for d, x, g in zip(dys, xs, gnames)]
    sizes = ops.grouped_allgather_tensors([tf.reshape(tf.shape(x, out_type=tf.int32)[0], [1]) for x in xs],
                                          [g + ".sizes" for g in gnames], ps)
    me = _set_index(ps)
    out = []
    for g, d in zip(grads, sizes):
        start = tf.reduce_sum(d[:me])
        out.append(g[start:start + d[me]])
    return out


def _gathered(tensors, names, ps):
    """``grouped_allgather_tensors`` with Horovod's gradient."""
    if not _differentiable(tensors):
        return ops.grouped_allgather_tensors(tensors, names, ps)

    @tf.custom_gradient
    def gather(*xs):
        ys = ops.grouped_allgather_tensors(list(xs), names, ps)

        def grad(*dys):
            return _allgather_grad(dys, xs, names, ps)

        return ys, grad

    out = gather(*tensors)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _broadcasted(tensor, name, root_rank, ps):
    """``grouped_broadcast_tensors`` of one tensor with Horovod's gradient."""
    if not _differentiable([tensor]):
        return ops.grouped_broadcast_tensors([tensor], [name], root_rank, ps)[0]

    @tf.custom_gradient
    def bcast(x):
        y = ops.grouped_broadcast_tensors([x], [name], root_rank, ps)[0]

        def grad(dy):
            g = ops.allreduce_tensor(_zero_if_none(dy, x), ops.grad_name(name), ReduceOp.AVERAGE, process_set=ps)
            # g * 0, not tf.zeros_like(g): zeros of a known shape would not depend on the allreduce, so a
            # TF1 session would prune it on this rank and the root would wait for it (Horovod does the same)
            return g if api.rank() == root_rank else g * tf.cast(0, g.dtype)

        return y, grad

    return bcast(tensor)


def allreduce(tensor, param_index=0, num_params=1, compression=Compression.none, op=None, *, average=None,
              device_dense="", device_sparse="", prescale_factor=1.0, postscale_factor=1.0, name=None,
              process_set=global_process_set, ignore_name_scope=False):
    """Reduce ``tensor`` (``tf.Tensor``/``tf.Variable``, any shape and dtype, identical on every rank;
    or ``tf.IndexedSlices``) over all ranks; returns a tensor of the same shape and dtype.

    Positionally this follows SMDDP: ``allreduce(tensor, param_index, num_params, compression,
    op)`` (``param_index``/``num_params`` only describe the tensor's place in a list and default
    to 0/1).  Horovod's arguments are accepted as keywords (``average``, ``device_dense``,
    ``device_sparse``, ``prescale_factor``, ``postscale_factor``, ``name``, ``process_set``,
    ``ignore_name_scope``); a bool or ``None`` as the second positional argument is read as
    Horovod's ``average``.  ``op`` defaults to AVERAGE; giving both ``op`` and ``average`` raises
    ``ValueError``.  ``tf.IndexedSlices`` are allgathered (values and indices) and stay
    ``IndexedSlices``.  Mirrors ``smdistributed.dataparallel.tensorflow.allreduce`` and
    ``horovod.tensorflow.allreduce``."""
    if (type(tensor) is _EagerTensor and type(param_index) is int and param_index == 0 and num_params == 1
            and compression is Compression.none and average is None and not device_dense and not device_sparse
            and process_set is global_process_set):  # (the common eager call: ops.eager_allreduce, or below)
        out = ops.eager_allreduce(tensor, name or "allreduce.eager", ReduceOp.AVERAGE if op is None else op,
                                  prescale_factor, postscale_factor)
        if out is not None:
            return out
    if param_index is None or isinstance(param_index, bool):  # horovod: allreduce(tensor, average, ...)
        if average is not None:
            raise ValueError("average given twice (positionally and as a keyword)")
        average, param_index = param_index, 0
        if isinstance(num_params, str):
            device_dense, num_params = num_params, 1
    if not isinstance(param_index, (int, np.integer)) or not isinstance(num_params, (int, np.integer)) \
            or not 0 <= param_index < max(num_params, 1):
        raise ValueError(f"param_index={param_index!r} and num_params={num_params!r}: expected integers with "
                         "0 <= param_index < num_params")
    check_devices(device_dense, device_sparse)
    ps = check_process_set(process_set)
    op = _check_op(resolve_op(op, average), ps)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, op, prescale_factor, postscale_factor, name, ps)
    tensor = ops._as_tensor(tensor)
    compressed, ctx = compression.compress(tensor)
    out = ops.allreduce_tensor(compressed, ops._base_name("allreduce", tensor, name), op, prescale_factor,
                               postscale_factor, ps)
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Allreduce a list of tensors in one op (fused by the engine); returns a list of tensors with
    the same shapes and dtypes (``IndexedSlices`` are allgathered, as in ``allreduce``).
    Mirrors ``horovod.tensorflow.grouped_allreduce``."""
    check_devices(device_dense, device_sparse)
    ps = check_process_set(process_set)
    op = _check_op(resolve_op(op, average), ps)
    tensors = list(tensors)
    if not tensors:
        return tensors
    first = next((t for t in tensors if not isinstance(t, tf.IndexedSlices)), None)
    base = ops._base_name("grouped_allreduce", first, name)
    out = [None] * len(tensors)
    dense_idx = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out[i] = _sparse_allreduce(t, op, prescale_factor, postscale_factor, f"{base}.{i}", ps)
    if dense_idx:
        comp = [compression.compress(ops._as_tensor(tensors[i])) for i in dense_idx]
        reduced = ops.grouped_allreduce_tensors([c for c, _ in comp], [f"{base}.{i}" for i in dense_idx], op,
                                                prescale_factor, postscale_factor, ps)
        for i, r, (_, ctx) in zip(dense_idx, reduced, comp):
            out[i] = compression.decompress(r, ctx)
    return out


def oob_allreduce(tensor, compression=Compression.none, op=ReduceOp.AVERAGE):
    """Out-of-band allreduce for non-gradient tensors (e.g. a loss to report); returns the reduced
    tensor (same shape and dtype).  Mirrors ``smdistributed.dataparallel.tensorflow.oob_allreduce``;
    in sdp it is the same engine path as ``allreduce``, and every ``ReduceOp`` works."""
    return allreduce(tensor, compression=compression, op=op)


def overlap(tensor):
    """Identity (returns ``tensor``).  Mirrors ``smdistributed.dataparallel.tensorflow.overlap``, a
    scheduling hint for XLA-compiled models; sdp overlaps communication with the backward pass in
    its engine thread without hints."""
    return tf.identity(tensor)


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Return ``root_rank``'s ``tensor`` on every rank (same shape and dtype everywhere).
    Mirrors ``smdistributed.dataparallel.tensorflow.broadcast`` / ``horovod.tensorflow.broadcast``.
    A ``root_rank`` outside ``[0, size)`` raises ``TensorMismatchError`` on every rank."""
    ps = check_process_set(process_set)
    tensor = ops._as_tensor(tensor)
    return _broadcasted(tensor, ops._base_name("broadcast", tensor, name), int(root_rank), ps)


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order (the first
    dimension may differ per rank; the others and the dtype must agree).  The result's static
    first dimension is unknown.  Mirrors ``horovod.tensorflow.allgather``."""
    ps = check_process_set(process_set)
    tensor = ops._as_tensor(tensor)
    return _gathered([tensor], [ops._base_name("allgather", tensor, name)], ps)[0]


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """``allgather`` of each tensor of a list, in one op.  Mirrors
    ``horovod.tensorflow.grouped_allgather``."""
    ps = check_process_set(process_set)
    tensors = [ops._as_tensor(t) for t in tensors]
    if not tensors:
        return []
    base = ops._base_name("grouped_allgather", tensors[0], name)
    return _gathered(tensors, [f"{base}.{i}" for i in range(len(tensors))], ps)


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Send ``splits[j]`` rows (first dimension) of ``tensor`` to rank j and return what every rank
    sent here, concatenated in rank order.  ``splits`` (ints, length ``size``, summing to the first
    dimension) defaults to an equal split.  Returns the tensor, or ``(tensor, received_splits)``
    (int32, shape ``[size]``) when ``splits`` is given.  Mirrors ``horovod.tensorflow.alltoall``."""
    ps = check_process_set(process_set)
    tensor = ops._as_tensor(tensor)
    base = ops._base_name("alltoall", tensor, name)
    if not _differentiable([tensor]):
        out, rsplits = ops.alltoall_tensor(tensor, splits, base, ps)
        return (out, rsplits) if splits is not None else out
    box = []

    @tf.custom_gradient
    def exchange(x):
        y, rs = ops.alltoall_tensor(x, splits, base, ps)
        box.append(rs)

        def grad(dy):  # Horovod's: send each rank's rows of the gradient back with the received splits
            return ops.alltoall_tensor(_zero_if_none(dy, x), rs, ops.grad_name(base), ps)[0]

        return y, grad

    out = exchange(tensor)
    return (out, box[-1]) if splits is not None else out


def reducescatter(tensor, device_dense="", compression=Compression.none, op=ReduceOp.AVERAGE, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce ``tensor`` (same shape on every rank, at least 1-D) and return this rank's block of
    the first dimension (lower ranks get one extra row when it does not divide evenly).
    ``op`` defaults to AVERAGE.  Mirrors ``horovod.tensorflow.reducescatter``."""
    check_devices(device_dense, "")
    ps = check_process_set(process_set)
    op = resolve_op(op)
    if op == ReduceOp.ADASUM:
        raise NotImplementedError("reducescatter does not support op=Adasum (an allreduce's op, as in Horovod)")
    tensor = ops._as_tensor(tensor)
    compressed, ctx = compression.compress(tensor)
    base = ops._base_name("reducescatter", tensor, name)
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE) or not _differentiable([compressed]):
        out = ops.reducescatter_tensor(compressed, base, op, prescale_factor, postscale_factor, ps)
        return compression.decompress(out, ctx)

    @tf.custom_gradient
    def scatter(x):
        y = ops.reducescatter_tensor(x, base, op, prescale_factor, postscale_factor, ps)

        def grad(dy):  # Horovod's: allgather of the gradient, times the set's size for Sum
            scale = float(prescale_factor) * float(postscale_factor) * (set_size(ps) if op == ReduceOp.SUM else 1)
            dy = _zero_if_none(dy, y)
            if scale != 1.0:
                dy = dy * tf.cast(scale, dy.dtype)
            return ops.allgather_tensor(dy, ops.grad_name(base), ps)

        return y, grad

    return compression.decompress(scatter(compressed), ctx)


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=ReduceOp.AVERAGE,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """``reducescatter`` of each tensor of a list.  Mirrors
    ``horovod.tensorflow.grouped_reducescatter``."""
    return [reducescatter(t, device_dense, compression, op, None, process_set, False, prescale_factor,
                          postscale_factor) for t in tensors]


def join():
    """Declare that this rank has run out of data; until every rank has joined, this rank's part
    of the others' allreduces (Sum/Average) is zeros (Average still divides by ``size()``).
    Blocks until all ranks have joined and returns the rank that joined last, as an int32
    scalar tensor.  Mirrors ``horovod.tensorflow.join``; eager only.  Other collectives that
    involve a joined rank raise ``TensorMismatchError`` on every rank."""
    return tf.constant(api.join(), tf.int32)


def barrier(process_set=global_process_set):
    """Block until every rank reaches the barrier.  Mirrors ``horovod.tensorflow.barrier``."""
    api.barrier(check_process_set(process_set))


def _runtime_int(fn, name, what):
    def body():
        return np.int32(fn())
    api.runtime(what)
    ops.check_not_xla(what)
    out = tf.numpy_function(body, [], tf.int32, name=name)
    out.set_shape([])
    return out


def size_op(process_set_id=0, name=None):
    """A scalar int32 op returning the size of process set ``process_set_id`` (0: ``size()``) when it
    runs (not when it is built; an unknown set then raises).  Mirrors ``horovod.tensorflow.size_op``."""
    return _runtime_int(lambda: set_size(int(process_set_id)), name, "size_op()")


def local_size_op(name=None):
    """A scalar int32 op returning ``local_size()``.  Mirrors ``horovod.tensorflow.local_size_op``."""
    return _runtime_int(api.local_size, name, "local_size_op()")


def rank_op(name=None):
    """A scalar int32 op returning ``rank()``.  Mirrors ``horovod.tensorflow.rank_op``."""
    return _runtime_int(api.rank, name, "rank_op()")


def local_rank_op(name=None):
    """A scalar int32 op returning ``local_rank()``.  Mirrors ``horovod.tensorflow.local_rank_op``."""
    return _runtime_int(api.local_rank, name, "local_rank_op()")


def process_set_included_op(process_set_id=0, name=None):
    """A scalar int32 op: 1 if this rank is in process set ``process_set_id`` when it runs, 0 if
    not, -3 (Horovod's HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET) for an unknown set.  Mirrors
    ``horovod.tensorflow.process_set_included_op``."""
    def included():
        ranks = api.process_set_ranks(int(process_set_id))
        return -3 if ranks is None else int(api.rank() in ranks)
    return _runtime_int(included, name, "process_set_included_op()")
