"""TensorFlow ops over the engine: eagerly, direct engine calls; in ``tf.function`` and
``tf.compat.v1`` graphs, ops that never park one of TensorFlow's threads waiting for a peer while
work that a peer waits for is queued behind it.

**Eagerly** a collective hands read-only views of its inputs to ``sdp.api`` (no copy), waits
on the Python thread that called it, and returns the engine's results as tensors through DLPack
(no copy when the engine aligned them on 64 bytes, as it does).  No graph op round trip;
gradients come from ``tf.custom_gradient``, set up only while a tape may record.

**In graphs** the engine is called from ops that call Python: sdp's compiled ``SdpCall`` op
where it is built (``_checked_numpy_function``, ``_submit_op``; ~30 us less per op than
a ``numpy_function``, and its failures get TensorFlow's status classes), else a
``tf.numpy_function`` (followed by sdp's compiled ``SdpCheck`` for those classes; not
``tf.py_function``: inputs arrive as numpy views of TensorFlow's buffers and aligned numpy
outputs are taken without a copy, with no ``EagerTensor`` wrapping either way, ~10 us less per
op here).  A graph op that blocks until the
peers submitted holds one of TensorFlow's inter-op threads (2 on a 2-core machine, 1 with
``inter_op_parallelism_threads=1``).  A graph with many independent collectives, created in a
different order on each rank, could then deadlock: every thread of rank 0 waits in a collective
whose submission on rank 1 is queued behind rank 1's own waiting threads (Horovod's kernels are
asynchronous for this reason).  Inside a ``tf.function`` it would deadlock even with many threads,
because automatic control dependencies run stateful ops without resource inputs in program order.
The design:

* A list of collectives (``Batch``) becomes *submit* ops, one per bucket of at most the
  fusion threshold: ops without outputs that hand input views to the engine and return at once
  (they never wait for a peer).  Inside a ``tf.function`` they are marked as independent side
  effects (``AutomaticControlDependencies.run_independently``): they still always run, but are
  not chained in program order with other stateful ops.
* One *wait* op collects the results: ``IteratorGetNext`` on a per-op ``tf.data`` iterator over
  an endless dataset whose ``map`` is a ``numpy_function`` that takes this step's handles (left
  by the submit ops, on which the wait op has control dependencies) and blocks on them.
  ``IteratorGetNext`` is an asynchronous kernel: the map function runs on the iterator's own
  background thread, so the inter-op thread is released while the peers catch up.  Every
  submit op can thus run whatever the number of inter-op threads and the order TensorFlow
  picks, so every rank submits every collective whose inputs it has, and every wait ends.
  The iterator is made once per op (eagerly, when a ``tf.function`` is traced; a one-shot
  iterator in a ``tf.compat.v1`` graph), not per step.
* Exception, the cheap path: the first ``Batch`` built in an outermost ``tf.function``
  graph gets the graph's one *blocking* op, which holds an inter-op thread while it waits.  If
  the batch is one bucket (a single collective, or a gradient list under the fusion threshold)
  it is ONE op that runs the bucket synchronously (``api.grouped_allreduce_named``, which the
  fast lane may run whole in the op's thread; eagerly too) (no submit op, no thread handover:
  a 1 KB allreduce in a ``tf.function`` took 0.48 instead of 0.55 ms with a submit op and a
  blocking wait op, 0.67 ms with an asynchronous wait, same window); with several buckets the
  submit ops stay (each bucket starts as soon as its gradients exist) and the wait op blocks.
  The blocking op starts only after every submit op of its graph that it does not feed
  (control inputs, added when the trace ends, after automatic control dependencies added
  theirs: added earlier they could close a cycle, e.g. with a ``broadcast_variables`` after
  ``apply_gradients`` of the blocking op's results, as Horovod's TF2 examples do on their
  first batch).  It cannot deadlock: no rank has a second
  blocking op, so on every rank every other collective is handed to the engine by a submit op
  that needs no blocked thread (an asynchronous wait holds none); the collective a blocking op
  waits for is submitted on every other rank by such a submit op (it is not downstream of that
  rank's blocking op: a batch built first on one rank cannot depend on a batch built later),
  and by the blocking op itself here, which starts once this rank's other submit ops ran.  In
  a ``tf.function`` every stateful op runs on every call, so these edges make nothing run that
  would not have run.  A ``tf.compat.v1`` session runs only what the fetches need, and such
  edges would make a fetch run unrelated submit ops: there every wait op is asynchronous.
* Alltoall and reducescatter use the same pair (a submit op that leaves the input views, a wait
  op that runs the collective, always asynchronous).  Cost: an asynchronous wait op adds
  ~0.2-0.3 ms per step to a graph (the handover to the iterator's thread), paid once per list of
  tensors, not per tensor.

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
import functools
import threading
import traceback
import weakref

import numpy as np
import tensorflow as tf

from sdp import api
from sdp.common.errors import SdpError
from sdp.common.reduce_ops import ReduceOp, check_dtype
from sdp.engine import fusion
from sdp.engine.fusion import ALIGN_BYTES  # results start on this boundary: TensorFlow's EIGEN_MAX_ALIGN_BYTES
from sdp.common import errors as _errors
from sdp.tensorflow.errors import as_tf_error, graph_status, tf_errors

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


def _sanitize(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


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


@functools.lru_cache(maxsize=None)
def _device_path() -> bool:
    from sdp.common.util import cuda_built
    return cuda_built()


def eager_input(t):
    """An eager tensor as the engine takes it: a GPU tensor as a DLPack capsule when sdp can
    reduce on the device (PyCUDA installed: the engine's device path, no host copy), anything
    else as a numpy view."""
    if _device_path() and "GPU" in (getattr(t, "device", "") or "").upper():
        return tf.experimental.dlpack.to_dlpack(t)
    return np.asarray(t)


def _to_tensor(arr, dtype, np_dtype=None):
    """An engine result as an eager tensor of ``dtype`` (through DLPack without a copy when
    ``as_output`` can; a device result comes as a DLPack capsule).  ``np_dtype``: the numpy
    dtype ``arr`` has if known (an allreduce's result has its input's)."""
    if type(arr) is not np.ndarray:
        if type(arr).__name__ == "PyCapsule":
            return tf.experimental.dlpack.from_dlpack(arr)
        arr = np.asarray(arr, dtype=_numpy_dtype(dtype))
    elif arr.dtype is not np_dtype:
        arr = np.asarray(arr, dtype=_numpy_dtype(dtype))
    out = as_output(arr)
    return out if isinstance(out, tf.Tensor) else tf.convert_to_tensor(out, dtype)


def run_numpy(fn, tensors, out_dtypes, out_shapes, name, blocking=False):
    """Run ``fn(list of numpy arrays) -> list of arrays`` as a TensorFlow op.

    Inputs reach ``fn`` as read-only views (no copy); each output is cast to its entry of
    ``out_dtypes`` (TensorFlow dtypes), handed out without a copy when it is 64-byte aligned
    (eagerly through ``as_output``), then given its entry of ``out_shapes``.  Eagerly ``fn``
    is called at once (no graph op).  In graphs it is one op (``_checked_numpy_function``), or with
    ``blocking=True`` (``fn`` waits for peers) a submit op and
    an asynchronous wait op (see the module docstring), so it holds no inter-op thread.  With no
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


_NUMPY_DTYPES = {}  # tf.DType -> its numpy dtype (``as_numpy_dtype`` costs ~0.45 us a call)


def _numpy_dtype(dtype):
    got = _NUMPY_DTYPES.get(dtype)
    if got is None:
        got = _NUMPY_DTYPES[dtype] = dtype.as_numpy_dtype
    return got


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
        as its inputs exist, and one asynchronous *wait* op collects every result (see the module
        docstring): the engine reduces the first buckets while TensorFlow still computes the
        others (Horovod's per-gradient async ops, SMDDP's buckets)."""
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
            def submit_and_wait(*arrays):  # the cheap path: one op (see the module docstring)
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


def _take(queue):
    """What this step's submit op left in ``queue`` (the newest entry: older ones belong to steps
    that failed after their submit op ran, and are dropped)."""
    if not queue:
        raise SdpError("sdp wait op ran before its submit op (internal error)")
    entry = queue.pop()
    queue.clear()
    return entry


def _read_only(arrays) -> list:
    """``numpy_function`` inputs (views of TensorFlow's buffers, no copy) made read-only: the
    engine only reads them, and a TensorFlow tensor must never change under its consumers.
    (A scalar arrives as a numpy scalar: made a 0-d array.)"""
    out = [np.asarray(a) for a in arrays]
    for a in out:
        a.flags.writeable = False
    return out


def _submit_op(put, tensors, name):
    """An op without outputs (``SdpCall`` where built, else a ``numpy_function``) that calls
    ``put(arrays)`` (read-only input views; it
    must not block) and returns at once.  Inside a ``tf.function`` it is marked as an independent
    side effect: it always runs, but automatic control dependencies do not chain it in program
    order with other stateful ops (which could make it wait for a collective of a peer)."""
    def body(*arrays):
        put(_read_only(arrays))
        return []

    op_name = _sanitize("submit." + name)[:100] if name else None
    lib = _call_library(tensors, [])
    if lib is not None:  # (sdp's compiled SdpCall: ~30 us less a call; see _checked_numpy_function)
        op = lib.call(_call_body(body, []), list(tensors), [], name=op_name)
    else:
        op = tf.numpy_function(body, list(tensors), [], stateful=True, name=op_name)
    _independent(op)
    _SUBMITS.setdefault(op.graph, []).append(op)
    return op


def _order_submits_before_blocking(graph) -> None:
    """Make ``graph``'s blocking op start after every submit op of ``graph`` that it does not
    feed: run when the ``tf.function``'s trace ends, after automatic control dependencies added
    their edges.  (Added as submit ops are built, an edge could close a cycle that those edges
    complete later: ``apply_gradients`` on the blocking op's results, then ``broadcast_variables``
    of the updated variables, as in Horovod's TF2 examples, reads them after the updates.)"""
    blocking = _BLOCKING.get(graph)
    for op in _SUBMITS.pop(graph, ()):
        if blocking is not None and not _is_ancestor(blocking, op):
            blocking._add_control_input(op)


def _independent(op) -> None:
    """Inside a ``tf.function``: ``op`` always runs, but is not chained in program order with
    other stateful ops by automatic control dependencies."""
    acd = getattr(op.graph, "experimental_acd_manager", None)
    if acd is not None and getattr(op.graph, "_add_control_dependencies", False):
        acd.run_independently(op)


def _is_ancestor(a, op) -> bool:
    """True if operation ``a`` is ``op`` or one of its (data or control) inputs, transitively."""
    seen, todo = set(), [op]
    while todo:
        o = todo.pop()
        if o is a:
            return True
        if id(o) in seen:
            continue
        seen.add(id(o))
        todo.extend(t.op for t in o.inputs)
        todo.extend(o.control_inputs)
    return False


_DATA_OPTIONS = tf.data.Options()
# the map function must run only when the wait op asks for an element: no prefetching,
# no parallel map, no autotuning or other rewrites
_DATA_OPTIONS.experimental_optimization.apply_default_optimizations = False
_DATA_OPTIONS.autotune.enabled = False
for _opt in ("map_parallelization", "inject_prefetch", "parallel_batch"):
    if hasattr(_DATA_OPTIONS.experimental_optimization, _opt):
        setattr(_DATA_OPTIONS.experimental_optimization, _opt, False)
if hasattr(_DATA_OPTIONS, "experimental_warm_start"):
    _DATA_OPTIONS.experimental_warm_start = False


_ITERATORS = weakref.WeakKeyDictionary()  # FuncGraph -> the iterators its wait ops use


_BLOCKING = weakref.WeakKeyDictionary()  # outermost FuncGraph -> its one blocking wait op
_SUBMITS = weakref.WeakKeyDictionary()  # graph -> its submit ops (until its trace ends, see _blocking_op)


def _may_block(graph) -> bool:
    """True if the next wait op built in ``graph`` may be its blocking op: ``graph`` is an
    outermost ``tf.function`` graph (with automatic control dependencies) that has none yet."""
    return bool(getattr(graph, "building_function", False) and getattr(graph, "_add_control_dependencies", False)
                and not getattr(getattr(graph, "outer_graph", None), "building_function", False)
                and getattr(graph, "_scope_exit_callbacks", None) is not None  # its trace's end is seen
                and graph not in _BLOCKING)


def _wait_op(wait, dtypes, deps, name):
    """Tensors of ``dtypes`` returned by ``wait()`` (it may block for peers), computed after the
    ops ``deps``: the graph's blocking op when ``_may_block`` (``_blocking_op``), else
    asynchronous (``_async_wait``).  Only for ``Batch``, whose submit ops hand the
    collectives to the engine (alltoall and reducescatter start theirs in the wait op: two ranks
    each blocked in one of those would wait for each other)."""
    if not _may_block(tf.compat.v1.get_default_graph()):
        return _async_wait(wait, dtypes, deps, name)
    return _blocking_op(wait, [], dtypes, deps, name)


def _blocking_op(fn, tensors, dtypes, deps, name):
    """Tensors of ``dtypes`` returned by ``fn(*input arrays)``, a ``numpy_function`` that may block
    for peers and runs after the ops ``deps``: the one blocking op of the current (outermost
    ``tf.function``) graph, see ``_may_block``.  It starts only after every submit op of the
    graph that it does not feed (control inputs added when the trace ends, see
    ``_order_submits_before_blocking``); the module docstring says why this cannot deadlock."""
    graph = tf.compat.v1.get_default_graph()
    with tf.control_dependencies(deps):
        outs = _checked_numpy_function(fn, list(tensors), list(dtypes), name, independent=True,
                                       on_op=lambda op: _BLOCKING.__setitem__(graph, op))
    graph._add_scope_exit_callback(lambda: _order_submits_before_blocking(graph))
    return outs


_THROUGH_DATA = {}


def _through_data(lib) -> bool:
    """Whether a placeholder returned inside a ``tf.data`` map (by ``SdpCall`` where built, else a
    ``numpy_function``) comes out of the iterator with its buffer (no copy): then an asynchronous
    wait op's failure is checked after the iterator (``_async_wait``).  Tried once per process."""
    if "through_data" in _THROUGH_DATA:
        return _THROUGH_DATA["through_data"]
    held = []

    def body(_):
        held.append(lib.placeholder(np.float32))
        return [held[-1]]

    def element(z):
        if lib.calls:
            return lib.call(body, [z], [tf.float32])[0]
        return tf.numpy_function(body, [z], tf.float32, stateful=True)

    with tf.Graph().as_default() as g:
        data = tf.data.Dataset.from_tensors(np.int64(0)).repeat().map(element).with_options(_DATA_OPTIONS)
        address = lib.module.sdp_buffer_address(tf.compat.v1.data.make_one_shot_iterator(data).get_next())
        with tf.compat.v1.Session(graph=g) as sess:
            got = int(sess.run(address))
    _THROUGH_DATA["through_data"] = bool(held) and got == held[-1].ctypes.data
    return _THROUGH_DATA["through_data"]


def _async_wait(wait, dtypes, deps, name):
    """Tensors of ``dtypes`` returned by ``wait()`` (it may block for peers), computed on a
    ``tf.data`` iterator's background thread by an ``IteratorGetNext`` op that runs after the ops
    ``deps``; TensorFlow's inter-op thread is free meanwhile (see the module docstring)."""
    dtypes = list(dtypes)
    from sdp.tensorflow import build_ops
    lib = build_ops.load()
    deferred = (lib is not None and bool(dtypes) and not np.dtype(dtypes[0].as_numpy_dtype).hasobject
                and _through_data(lib))

    def element(_):
        return tuple(_checked_numpy_function(lambda _z: wait(), [_], dtypes, name, deferred=deferred))

    def dataset():
        return tf.data.Dataset.from_tensors(np.int64(0)).repeat().map(
            tf.autograph.experimental.do_not_convert(element)).with_options(_DATA_OPTIONS)

    graph = tf.compat.v1.get_default_graph()
    if getattr(graph, "building_function", False):
        with tf.init_scope():  # made once, when the function is traced
            it = iter(dataset()) if tf.executing_eagerly() else tf.compat.v1.data.make_one_shot_iterator(dataset())
        _ITERATORS.setdefault(graph, []).append(it)  # they live as long as the function's graph
    else:
        it = tf.compat.v1.data.make_one_shot_iterator(dataset())
    with tf.control_dependencies(deps):
        outs = list(it.get_next())
    if deferred:  # the failure's status here, outside the tf.data function
        return lib.check(outs, name=f"{_sanitize(name)[:100]}.check" if name else None)
    return outs


_FAILED = {}  # buffer address -> a failed op's placeholder, kept alive until its SdpCheck op ran
_FAILED_LOCK = threading.Lock()


def _failed_result(lib, dtype, status):
    """A failed collective's first result: a new placeholder of ``dtype`` registered with the
    compiled op under ``status`` (its ``SdpCheck`` fails with it).  Placeholders are held here
    until their op ran (so no other buffer takes a registered address); those of ops that never
    run (their step failed elsewhere first) stay, a few bytes each."""
    with _FAILED_LOCK:
        for address in [a for a in _FAILED if not lib.pending(a)]:
            del _FAILED[address]
        ph = lib.placeholder(dtype)
        _FAILED[ph.ctypes.data] = ph
        lib.register(ph.ctypes.data, *status)
    return ph


def _checked_numpy_function(fn, inputs, dtypes, name, independent=False, on_op=None, deferred=False):
    """Tensors of ``dtypes`` returned by ``fn(*input arrays)`` (a list of arrays) run as a stateful
    op (passed to ``on_op``; ``independent``: marked as an independent side effect, see
    ``_independent``).

    With sdp's compiled ``SdpCall`` op (``sdp.tensorflow.build_ops``, for the dtypes it
    carries) that op calls ``fn``: ~30 us less than a ``numpy_function`` per call, and an error
    of ``fn`` becomes the op's status (``_call_status``: a mismatch across ranks
    ``FailedPreconditionError``, as Horovod's kernels fail it; otherwise the class a
    ``numpy_function`` would give).  Without it, a stateful ``numpy_function``: with sdp's
    compiled ``SdpCheck`` op, an error of ``fn`` that has a TensorFlow class
    (``sdp.tensorflow.errors.graph_status``) is not raised inside the ``numpy_function``, where
    TensorFlow would make it an ``InvalidArgumentError``: the ``numpy_function`` returns a
    registered placeholder (``_failed_result``) and empty arrays, and the ``SdpCheck`` op fed
    every result fails with that status, or forwards the results without a copy.  Any other
    error is raised as before.  Without the library (``SDP_TF_OPS=0``, no compiler), the plain
    ``numpy_function``.

    ``deferred`` (the library loaded and ``_through_data``): every error of ``fn`` becomes a
    registered placeholder (``_failing_into_placeholder``), and the outputs are returned
    unchecked: the caller feeds them to ``lib.check`` outside the ``tf.data`` function they run in,
    so that TensorFlow's error starts with sdp's message, not "Error in user-defined function
    passed to MapDataset ..." (``_async_wait``)."""
    dtypes = list(dtypes)
    op_name = _sanitize(name)[:100] if name else None
    from sdp.tensorflow import build_ops  # (here: `python -m sdp.tensorflow.build_ops` runs it as __main__)
    lib = build_ops.load()
    if deferred:
        fn = _failing_into_placeholder(fn, lib, [np.dtype(d.as_numpy_dtype) for d in dtypes])
        if _call_library(inputs, dtypes) is None:
            outs = tf.numpy_function(fn, inputs, dtypes, stateful=True, name=op_name)
            return list(outs) if isinstance(outs, (list, tuple)) else [outs]
    if dtypes and _call_library(inputs, dtypes) is not None:
        outs = lib.call(_call_body(fn, [np.dtype(d.as_numpy_dtype) for d in dtypes]), inputs, dtypes, name=op_name)
        if independent:
            _independent(outs[0].op)
        if on_op is not None:
            on_op(outs[0].op)
        return outs
    body = fn
    if lib is not None:
        np_dtypes = [np.dtype(d.as_numpy_dtype) for d in dtypes]

        def body(*arrays):
            try:
                return fn(*arrays)
            except (_errors.TensorMismatchError, tf.errors.OpError) as e:
                status = graph_status(e)
                if status is None or np_dtypes[0].hasobject:
                    raise
                return [_failed_result(lib, np_dtypes[0], status)] + [np.zeros(0, d) for d in np_dtypes[1:]]

    outs = tf.numpy_function(body, inputs, dtypes, stateful=True, name=op_name)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    if independent:
        _independent(outs[0].op)
    if on_op is not None:
        on_op(outs[0].op)
    if lib is None:
        return outs
    checked = lib.check(outs, name=f"{op_name}.check" if op_name else None)
    if independent:
        _independent(checked[0].op)
    return checked


def _failing_into_placeholder(fn, lib, np_dtypes):
    """``fn``, returning a placeholder registered with its error's status (``_call_status``)
    and empty arrays instead of raising."""
    def body(*arrays):
        try:
            return fn(*arrays)
        except Exception as e:  # noqa: BLE001 - every error becomes the check op's status
            return [_failed_result(lib, np_dtypes[0], _call_status(e))] + [np.zeros(0, d) for d in np_dtypes[1:]]
    return body


def _call_library(inputs, dtypes):
    """sdp's compiled library if its ``SdpCall`` op carries ``inputs``' and ``dtypes``' dtypes, else None."""
    from sdp.tensorflow import build_ops
    lib = build_ops.load()
    if (lib is None or not lib.calls or not all(d.name in build_ops.CALL_DTYPES for d in dtypes)
            or not all(getattr(getattr(t, "dtype", None), "name", None) in build_ops.CALL_DTYPES for t in inputs)):
        return None  # (an input without a dtype, a Python number: the numpy_function converts it)
    return lib


def _call_body(fn, np_dtypes):
    """``SdpCall``'s function for ``fn``: its results as a list of C-contiguous arrays of
    ``np_dtypes``, or, when it raises, ``(code, message)`` (``_call_status``)."""
    def call(*arrays):
        try:
            got = fn(*arrays)
        except Exception as e:  # noqa: BLE001 - the op's status, as a numpy_function's kernel makes one
            return _call_status(e)
        got = got if isinstance(got, (list, tuple)) else [got]
        if len(got) != len(np_dtypes):
            return 13, f"sdp: {len(got)} results for {len(np_dtypes)} outputs (not one array per output)".encode()
        out = []
        for r, d in zip(got, np_dtypes):
            a = np.asarray(r, dtype=d)
            out.append(a if a.flags.c_contiguous else a.copy(order="C"))
        return out
    return call


def _call_status(e: BaseException) -> tuple:
    """``(absl status code, UTF-8 message)`` for an error of ``SdpCall``'s function: TensorFlow's
    class where sdp's error has one (``graph_status``: a mismatch across ranks
    ``FAILED_PRECONDITION``), else the code a ``numpy_function``'s kernel gives the Python class
    (``ValueError``/``TypeError`` INVALID_ARGUMENT, ``StopIteration`` OUT_OF_RANGE,
    ``MemoryError`` RESOURCE_EXHAUSTED, ``NotImplementedError`` UNIMPLEMENTED, else UNKNOWN), with
    its message and traceback; sdp's own errors (a lost peer, a stall) without the traceback, which
    runs through sdp's internals only (TensorFlow repeats the status in a warning; an elastic job
    recovers from it)."""
    status = graph_status(e)
    if status is not None:
        return status
    code = next((c for cls, c in _PY_CODES if isinstance(e, cls)), 2)
    text = f"{type(e).__name__}: {e}"
    if not isinstance(e, _errors.SdpError):
        text += "\nTraceback (most recent call last):\n\n" + "".join(traceback.format_tb(e.__traceback__))
    return code, text.encode("utf-8", "replace")


_PY_CODES = ((ValueError, 3), (TypeError, 3), (StopIteration, 11), (MemoryError, 8), (NotImplementedError, 12))


def as_output(arr: np.ndarray):
    """``arr`` as an eager result: a tensor sharing its memory (through DLPack) when
    TensorFlow can use that memory as it is (C-contiguous, 64-byte aligned, as the engine's
    results are; TensorFlow aborts on a misaligned one), else ``arr`` itself, which TensorFlow
    copies (~6 GB/s here, 9 ms for 56 MB of gradients per step)."""
    step = fusion.compiled()
    if (step.exportable(arr) if step is not None else  # (~0.1 us, where the attributes below take ~1.5)
            arr.size and arr.flags.c_contiguous and arr.flags.writeable and arr.ctypes.data % ALIGN_BYTES == 0):
        try:
            return _from_dlpack(arr.__dlpack__())
        except (BufferError, TypeError, ValueError, tf.errors.OpError):  # a dtype DLPack does not carry
            pass
    return arr


_from_dlpack = tf.experimental.dlpack.from_dlpack


def eager_allreduce(t, name: str, op: ReduceOp, prescale_factor, postscale_factor):
    """``allreduce_tensor`` of one eager tensor of the global set, as Horovod's eager
    ``allreduce`` is mostly called, without its layers (a list, a batch, the gradient's wrapper,
    the TF dtype's check), or None where that does not apply (not executing eagerly, a tape that
    could record, an op that is not a ``ReduceOp`` or is Adasum, a tensor whose numpy view
    is not of an integer or float dtype, a GPU tensor where the device path is built): 1 KB
    13.9 -> ~6.7 us here, over a floor (numpy view, ``sdp.allreduce``, DLPack back) of 4.8."""
    if (not tf.executing_eagerly() or _could_record() or type(op) is not ReduceOp or op is ReduceOp.ADASUM
            or _device_path()):
        return None
    try:
        x = np.asarray(t)
    except (TypeError, ValueError, tf.errors.OpError):  # (a dtype numpy cannot view)
        return None
    if x.dtype.kind not in "iuf":  # (that, bool, strings, bfloat16: the layers check them, naming TF's dtype)
        return None
    try:
        got = api.allreduce(x, name, op, float(prescale_factor), float(postscale_factor))
    except _errors.TensorMismatchError as e:  # (tf_errors' mapping without its with block: ~0.2 us)
        new = as_tf_error(e)
        if new is e:
            raise
        raise new from e
    if type(got) is np.ndarray and got.dtype is x.dtype:
        out = as_output(got)
        if out is not got:  # (a tensor over the result's memory)
            return out
    return _to_tensor(got, t.dtype, x.dtype)


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


@functools.lru_cache(maxsize=None)
def _record_check():
    """TensorFlow's ``could_possibly_record`` (looked up once), or None where its internals moved."""
    try:
        from tensorflow.python.eager import record
    except ImportError:  # pragma: no cover - TF internals moved
        return None
    return record.could_possibly_record


def _always() -> bool:
    return True


#: () -> False when no ``tf.GradientTape`` could record an eager op now (``tf.custom_gradient``
#: costs ~0.1 ms per call, for nothing then); True where TensorFlow's check moved
_could_record = _record_check() or _always


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
