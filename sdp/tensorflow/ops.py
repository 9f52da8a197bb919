"""TensorFlow ops over the engine: eagerly, direct engine calls; in ``tf.function`` and
``tf.compat.v1`` graphs, ops that never park one of TensorFlow's threads waiting for a peer while
work that a peer waits for is queued behind it.

Eagerly a collective calls the engine directly on the caller's thread
(``sdp.tensorflow.eager_ops``); in graphs it is built from submit and wait ops
(``sdp.tensorflow.graph_ops``, whose docstring gives the design and why it cannot deadlock).
This module holds the collectives over tensors that both use (``Batch``, ``run_numpy``, the
``*_tensor(s)`` functions), the collective names and the XLA check; the names other modules
import from here (``as_output``, ``eager_allreduce``, ...) stay importable from here.

What a collective in a ``tf.function`` costs above the engine is bounded below by the call of a
``tf.function`` holding one ``numpy_function`` (no collective; ~0.13 ms here with TensorFlow's
threads not spinning, see ``sdp.tensorflow.threads``, of which ~0.09-0.13 ms is the call of an
empty ``tf.function``); ``benchmarks/allreduce.py --api`` measures these in the same run, and the
``floor`` of this design (a ``tf.function`` whose one ``numpy_function`` calls the engine), which
the ops here match within noise.  Names identify a collective across ranks (see ``unique_name``).
``numpy_function`` cannot be compiled by XLA: every op here raises ``XlaNotSupportedError``
when it is built inside a ``jit_compile=True`` function.
"""
import collections

import numpy as np
import tensorflow as tf

from sdp import api
from sdp.common.errors import SdpError
from sdp.common.reduce_ops import ReduceOp, check_dtype
from sdp.engine import fusion
from sdp.tensorflow.eager_ops import (  # noqa: F401 - importable from here
    _could_record, _numpy_dtype, _to_tensor, as_output, eager_allreduce, eager_input)
from sdp.tensorflow.errors import tf_errors
from sdp.tensorflow.graph_ops import (  # noqa: F401 - importable from here
    _async_wait, _blocking_op, _call_body, _call_library, _checked_numpy_function, _may_block, _read_only,
    _sanitize, _submit_op, _take, _wait_op)

def _autograph_skips_sdp() -> None:
    """Tell AutoGraph not to convert sdp's own functions when a ``tf.function`` calls them, as it
    does not convert TensorFlow's or Keras's: they use no Python control flow on tensors, and
    converting them cost ~1 s of tracing per collective in a ``tf.function`` (30 collectives:
    minutes).  A user's functions are still converted as usual."""
    try:
        from tensorflow.python.autograph.core import config, config_lib
    except ImportError:  # pragma: no cover - TF internals moved: sdp is then converted, slowly
        return
    if not any(isinstance(r, config_lib.DoNotConvert) and r.matches("sdp") for r in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (config_lib.DoNotConvert("sdp"),) + tuple(config.CONVERSION_RULES)


_autograph_skips_sdp()


class XlaNotSupportedError(SdpError, NotImplementedError):
    """An sdp collective was placed in a function compiled with XLA (``jit_compile=True``).

    sdp's collectives run as ops that call Python (sdp's ``SdpCall``, or ``tf.numpy_function``),
    which XLA cannot compile.  Compile the model
    or function with ``jit_compile=False``."""

    # AutoGraph re-raises an error from traced code with its own type only if the type's __init__
    # is Exception's (otherwise it substitutes a StagingError): keep the type visible to callers.
    __init__ = Exception.__init__


def _in_xla_context() -> bool:
    if tf.executing_eagerly():
        return False
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - TF internals moved
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def check_not_xla(what: str) -> None:
    """Raise ``XlaNotSupportedError`` if the op being built would be compiled by XLA."""
    if _in_xla_context():
        raise XlaNotSupportedError(
            f"sdp {what} cannot run inside an XLA-compiled function (jit_compile=True): sdp's "
            "collectives are ops that call Python (SdpCall or tf.numpy_function), which XLA cannot "
            "compile. Use jit_compile=False "
            "(for Keras: model.compile(..., jit_compile=False); for tf.function: "
            "tf.function(fn, jit_compile=False)).")


def unique_name(base: str) -> str:
    """A name for a collective that is the same on every rank.

    In a graph (``tf.function`` or ``tf.compat.v1``) it is made unique within that graph by the
    graph's own name counter, so it is deterministic as long as every rank builds the same graph.
    Eagerly it is ``base`` itself: eager collectives run one after another, and a fixed name lets
    the engine's response cache hit on every step."""
    if tf.executing_eagerly():
        return base
    return tf.compat.v1.get_default_graph().unique_name("sdp." + _sanitize(base), mark_as_used=True)


def grad_name(name: str) -> str:
    """The name of the collective in the gradient of collective ``name``: ``<name>.grad``, in a
    graph made unique there by the graph's name counter (``<name>.grad_1``, ...), as Horovod's
    gradient ops are named by their graph nodes: several ``tf.gradients`` of one op evaluated in
    one ``Session.run`` must not meet under one name.  Eagerly ``<name>.grad`` (gradients are
    computed one after another)."""
    if tf.executing_eagerly():
        return name + ".grad"
    graph = tf.compat.v1.get_default_graph()
    with graph.name_scope(None):  # (the gradient's name scope differs per tf.gradients call: left out)
        return graph.unique_name(name + ".grad", mark_as_used=True)


def _base_name(kind: str, tensor=None, name=None) -> str:
    """Name of a user-level collective: ``name`` if given; in graphs, from the input's op name,
    made unique in the graph (``unique_name``); eagerly, ``"<kind>.eager"``, like Horovod's
    eager ops: eager collectives complete one after another, so every rank's n-th unnamed call
    meets the others' n-th call, and the engine's response cache hits on every step."""
    if name:
        return name
    if not tf.executing_eagerly():
        op = getattr(tensor, "op", None)
        return unique_name(f"{kind}.{op.name}" if op is not None else kind)
    return f"{kind}.eager"


def _as_tensor(t):
    if isinstance(t, tf.Tensor):
        return t
    if isinstance(t, tf.Variable) or hasattr(t, "read_value"):
        return tf.convert_to_tensor(t)
    value = getattr(t, "value", None)  # Keras 3 variables
    if value is not None and not isinstance(t, np.ndarray):
        return tf.convert_to_tensor(value() if callable(value) else value)
    return tf.convert_to_tensor(t)


def run_numpy(fn, tensors, out_dtypes, out_shapes, name, blocking=False):
    """Run ``fn(list of numpy arrays) -> list of arrays`` as a TensorFlow op.

    Inputs reach ``fn`` as read-only views (no copy); each output is cast to its entry of
    ``out_dtypes`` (TensorFlow dtypes), handed out without a copy when it is 64-byte aligned
    (eagerly through ``as_output``), then given its entry of ``out_shapes``.  Eagerly ``fn``
    is called at once (no graph op).  In graphs it is one op (``_checked_numpy_function``), or with
    ``blocking=True`` (``fn`` waits for peers) a submit op and
    an asynchronous wait op (see ``sdp.tensorflow.graph_ops``), so it holds no inter-op thread.  With no
    ``out_dtypes`` (a side effect) returns ``[]`` eagerly, the operation in graphs."""
    out_dtypes = [tf.as_dtype(d) for d in out_dtypes]
    np_dtypes = [d.as_numpy_dtype for d in out_dtypes]
    if tf.executing_eagerly():
        with tf_errors():
            outs = fn([np.asarray(_as_tensor(t)) for t in tensors])
        return [_to_tensor(o, d) for o, d in zip(outs, out_dtypes)] if out_dtypes else []

    def results(outs):
        return [np.asarray(o, dtype=d) for o, d in zip(outs, np_dtypes)]

    if blocking and out_dtypes:
        pending = collections.deque()
        submit = _submit_op(pending.append, tensors, name)
        # (the collective starts in the wait op: never a blocking one, see _wait_op)
        outs = _async_wait(lambda: results(fn(_take(pending))), out_dtypes, [submit], name)
    else:
        def body(*arrays):
            return results(fn(_read_only(arrays)))

        if not out_dtypes:
            lib = _call_library(tensors, [])
            if lib is not None:  # (sdp's compiled SdpCall, as _checked_numpy_function)
                return lib.call(_call_body(body, []), list(tensors), [], name=_sanitize(name)[:100] if name else None)
            return tf.numpy_function(body, list(tensors), [], stateful=True,
                                     name=_sanitize(name)[:100] if name else None)
        outs = _checked_numpy_function(body, list(tensors), out_dtypes, name)
    outs = list(outs)
    for o, s in zip(outs, out_shapes):
        o.set_shape(s)
    return outs


def _gathered_shape(t) -> tf.TensorShape:
    return tf.TensorShape([None]).concatenate(t.shape[1:]) if t.shape.rank else tf.TensorShape(None)


def _check_dtype(t, kind: str, name: str, *reduction) -> None:
    """``check_dtype`` for a tensor, showing TensorFlow's dtype name (``tf.string`` holds Python
    objects: no collective carries it, as with Horovod's ops)."""
    dtype = t.dtype
    if reduction and reduction[0] == ReduceOp.ADASUM:  # (float16/32/64 only: check_dtype's own rule)
        return check_dtype(kind, name, _numpy_dtype(dtype), *reduction, shown=dtype.name)
    if dtype in _PLAIN_DTYPES:  # (any collective, op and scale: check_dtype's common case)
        return
    if np.dtype(_numpy_dtype(dtype)).kind in "iuf":
        _PLAIN_DTYPES.add(dtype)
        return
    check_dtype(kind, name, _numpy_dtype(dtype), *reduction, shown=dtype.name)


_PLAIN_DTYPES = set()  # TensorFlow dtypes whose numpy dtype is an integer or float one


class Batch:
    """Several collectives built together: allreduces (fused together by the engine), allgathers
    and broadcasts, started by submit ops and collected by one wait op (see ``run``).
    ``add_*`` returns the index of the result in ``run``'s list."""

    def __init__(self, what: str = "collective", process_set: int = 0):
        self.what = what
        self.process_set = process_set  # process set id (sdp.api), 0: all ranks
        self._reduce = []  # (index, tensor, name)
        self._reduce_args = None
        self._gather = []
        self._bcast = []
        self._tensors = []
        self._shapes = []

    def _add(self, tensor, shape):
        self._tensors.append(tensor)
        self._shapes.append(shape)
        return len(self._tensors) - 1

    def add_allreduce(self, tensor, name, op, prescale_factor=1.0, postscale_factor=1.0) -> int:
        args = (ReduceOp(int(op)), float(prescale_factor), float(postscale_factor))
        if self._reduce_args is not None and args != self._reduce_args:
            raise ValueError("all allreduces of one batch must share op and scale factors")
        self._reduce_args = args
        t = _as_tensor(tensor)
        _check_dtype(t, "allreduce", name, *args)
        i = self._add(t, t.shape)
        self._reduce.append((i, name))
        return i

    def add_allgather(self, tensor, name) -> int:
        t = _as_tensor(tensor)
        _check_dtype(t, "allgather", name)
        i = self._add(t, _gathered_shape(t))
        self._gather.append((i, name))
        return i

    def add_broadcast(self, tensor, name, root_rank) -> int:
        t = _as_tensor(tensor)
        _check_dtype(t, "broadcast", name)
        i = self._add(t, t.shape)
        self._bcast.append((i, name, int(root_rank)))
        return i

    def run(self):
        """Build (graph) or run (eager) the ops; returns the result tensors in ``add_*`` order.

        The allreduces are split into buckets of at most the fusion threshold (bytes, walked from
        the last tensor to the first: in a backward pass the last layers' gradients are ready
        first).  Eagerly every bucket is handed to the engine, then every result is awaited.  In
        a graph each bucket is handed to the engine by its own non-blocking *submit* op as soon
        as its inputs exist, and one asynchronous *wait* op collects every result (see
        ``sdp.tensorflow.graph_ops``): the engine reduces the first buckets while TensorFlow still
        computes the others (Horovod's per-gradient async ops, SMDDP's buckets)."""
        api.runtime(f"{self.what}()")
        check_not_xla(self.what)
        if not self._tensors:
            return []
        groups = [("allreduce", b) for b in _buckets(self._reduce, self._tensors, api.fusion_threshold())]
        if self._gather or self._bcast:
            groups.append(("other", self._gather + self._bcast))
        rargs = self._reduce_args
        order = [it[0] for _, items in groups for it in items]
        starters = [(_starter(kind, items, rargs, self.process_set), [self._tensors[it[0]] for it in items])
                    for kind, items in groups]
        names = [it[1] for it in groups[0][1]] if len(groups) == 1 and groups[0][0] == "allreduce" else None

        def run(arrays_per_group):  # where the caller waits: every group started, then their results
            if names is not None:  # (one bucket of allreduces: synchronously, so that the engine may run it
                return api.grouped_allreduce_named(  # whole in this thread, see sdp.api.allreduce; never in
                    arrays_per_group[0], names, *rargs, process_set=self.process_set)  # a submit op: it must not block)
            handles = [h for (start, _), arrays in zip(starters, arrays_per_group) for h in start(arrays)]
            return [h.wait() for h in handles]

        if tf.executing_eagerly():
            with tf_errors():  # Horovod's tf.errors classes (sdp.tensorflow.errors)
                got = run([[eager_input(t) for t in ts] for _, ts in starters])
                result = [None] * len(order)
                for i, r in zip(order, got):
                    result[i] = _to_tensor(r, self._tensors[i].dtype)
            return result
        name = (self._reduce or self._gather or self._bcast)[0][1]
        dtypes = [self._tensors[i].dtype for i in order]
        np_dtypes = [d.as_numpy_dtype for d in dtypes]
        if len(starters) == 1 and _may_block(tf.compat.v1.get_default_graph()):
            def submit_and_wait(*arrays):  # the cheap path: one op (see sdp.tensorflow.graph_ops)
                return [np.asarray(r, dtype=d) for r, d in zip(run([_read_only(arrays)]), np_dtypes)]

            outs = _blocking_op(submit_and_wait, starters[0][1], dtypes, [], name)
        else:
            queues = [collections.deque() for _ in starters]
            submits = [_submit_op(lambda arrays, q=q, start=start: q.append(start(arrays)), ts, f"{name}.{k}")
                       for k, (q, (start, ts)) in enumerate(zip(queues, starters))]

            def wait():
                handles = [h for q in queues for h in _take(q)]
                return [np.asarray(h.wait(), dtype=d) for h, d in zip(handles, np_dtypes)]

            outs = _wait_op(wait, dtypes, submits, name)
        result = [None] * len(order)
        for i, o in zip(order, outs):
            o.set_shape(self._shapes[i])
            result[i] = o
        return result


def _buckets(reduce, tensors, threshold):
    """``reduce`` entries ``(index, name)`` in buckets of <= ``threshold`` bytes, last entry first."""
    items = list(reversed(reduce))
    return fusion.runs(items, [(tensors[i].shape.num_elements() or 0) * tensors[i].dtype.size for i, _ in items],
                       threshold)


def _starter(kind, items, rargs, ps=0):
    """``fn(arrays) -> handles`` that hands ``items``' collectives (of process set ``ps``) to the engine."""
    def start(arrays):
        if kind == "allreduce":
            op, pre, post = rargs
            return api.grouped_allreduce_async(arrays, [it[1] for it in items], op, pre, post, process_set=ps)
        handles, by_root = {}, {}
        for a, it in zip(arrays, items):
            if len(it) == 2:
                handles[it[0]] = api.allgather_async(a, it[1], process_set=ps)
            else:
                by_root.setdefault(it[2], []).append((it[0], a, it[1]))
        for root, group in by_root.items():
            hs = api.grouped_broadcast_async([a for _, a, _ in group], root, [n for *_, n in group], process_set=ps)
            handles.update((i, h) for (i, _, _), h in zip(group, hs))
        return [handles[it[0]] for it in items]
    return start


def _grouped_allreduce_raw(tensors, names, op, prescale_factor=1.0, postscale_factor=1.0, process_set=0):
    if len(tensors) == 1 and tf.executing_eagerly():  # (what Batch.run does for one eager tensor, without
        t, args = tensors[0], (op if type(op) is ReduceOp else ReduceOp(int(op)), float(prescale_factor),  # the
                               float(postscale_factor))  # batch:
        _check_dtype(t, "allreduce", names[0], *args)  # 1 KB ~32 -> ~20 us)
        with tf_errors():
            x = eager_input(t)
            return [_to_tensor(api.allreduce(x, names[0], *args, process_set=process_set), t.dtype,
                               getattr(x, "dtype", None))]
    b = Batch("allreduce", process_set)
    for t, n in zip(tensors, names):
        b.add_allreduce(t, n, op, prescale_factor, postscale_factor)
    return b.run()


def grouped_allreduce_tensors(tensors, names, op, prescale_factor=1.0, postscale_factor=1.0, process_set=0):
    """Allreduce a list of tensors in one op (fused by the engine); same shapes/dtypes out.

    Differentiable for SUM, AVERAGE and ADASUM: the gradient is the same allreduce of the incoming
    gradients (named ``<name>.grad``; Horovod's allreduce gradient); other ops have no gradient."""
    tensors = [_as_tensor(t) for t in tensors]
    if not tensors:
        return []
    op = op if type(op) is ReduceOp else ReduceOp(int(op))
    if ((tf.executing_eagerly() and not _could_record()) or op not in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.ADASUM)
            or not all(t.dtype.is_floating for t in tensors)):
        return _grouped_allreduce_raw(tensors, names, op, prescale_factor, postscale_factor, process_set)

    @tf.custom_gradient
    def reduce(*xs):
        ys = _grouped_allreduce_raw(list(xs), names, op, prescale_factor, postscale_factor, process_set)

        def grad(*dys):
            dys = [tf.zeros_like(x) if d is None else d for d, x in zip(dys, xs)]
            return _grouped_allreduce_raw(dys, [grad_name(n) for n in names], op, prescale_factor,
                                          postscale_factor, process_set)

        return ys, grad

    out = reduce(*tensors)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def allreduce_tensor(tensor, name, op, prescale_factor=1.0, postscale_factor=1.0, process_set=0):
    return grouped_allreduce_tensors([tensor], [name], op, prescale_factor, postscale_factor, process_set)[0]


def grouped_broadcast_tensors(tensors, names, root_rank, process_set=0):
    """Broadcast a list of tensors from ``root_rank`` in one op."""
    b = Batch("broadcast", process_set)
    for t, n in zip(tensors, names):
        b.add_broadcast(t, n, root_rank)
    return b.run()


def grouped_allgather_tensors(tensors, names, process_set=0):
    """Concatenate every rank's tensors along dimension 0, for each tensor of the list, in one op."""
    b = Batch("allgather", process_set)
    for t, n in zip(tensors, names):
        b.add_allgather(t, n)
    return b.run()


def allgather_tensor(tensor, name, process_set=0):
    """Concatenate every rank's tensor along dimension 0."""
    return grouped_allgather_tensors([tensor], [name], process_set)[0]


def alltoall_tensor(tensor, splits, name, process_set=0):
    """Send ``splits[j]`` rows of ``tensor`` to rank j; returns ``(received, received_splits)``
    (``received_splits`` is int32 of shape ``[size]``).  ``splits=None``: an equal split."""
    api.runtime("alltoall()")
    check_not_xla("alltoall")
    tensor = _as_tensor(tensor)
    _check_dtype(tensor, "alltoall", name)
    n = len(api.process_set_ranks(process_set) or ())
    if splits is None:
        splits_t = tf.zeros([0], tf.int32)
    else:
        splits_t = tf.reshape(tf.cast(_as_tensor(splits), tf.int32), [-1])

    def fn(arrays):
        a, s = arrays
        return api.alltoall(a, None if s.size == 0 else [int(x) for x in s], name, process_set)

    out, rsplits = run_numpy(fn, [tensor, splits_t], [tensor.dtype, tf.int32],
                              [_gathered_shape(tensor), tf.TensorShape([n])], name, blocking=True)
    return out, rsplits


def reducescatter_tensor(tensor, name, op, prescale_factor=1.0, postscale_factor=1.0, process_set=0):
    """Reduce ``tensor`` over ranks and return this rank's rows of dimension 0 (lower ranks get
    the extra rows when it does not divide evenly)."""
    api.runtime("reducescatter()")
    check_not_xla("reducescatter")
    tensor = _as_tensor(tensor)
    if tensor.shape.rank == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    _check_dtype(tensor, "reducescatter", name, ReduceOp(int(op)), float(prescale_factor), float(postscale_factor))

    def fn(arrays):
        return [api.reducescatter(arrays[0], name, op, prescale_factor, postscale_factor, process_set)]

    return run_numpy(fn, [tensor], [tensor.dtype], [_gathered_shape(tensor)], name, blocking=True)[0]


def np_dtype(dtype) -> np.dtype:
    return np.dtype(tf.as_dtype(dtype).as_numpy_dtype)
