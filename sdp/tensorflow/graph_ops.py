"""The graph ops that run sdp's collectives in ``tf.function`` and ``tf.compat.v1`` graphs: the
submit ops, the wait ops (blocking or on a ``tf.data`` iterator) and the op that calls Python
(sdp's compiled ``SdpCall``, else a ``numpy_function`` followed by ``SdpCheck``).  Kept apart
from ``sdp.tensorflow.ops`` (the collectives over tensors, which build on these) because this is
where TensorFlow's executor, threads and status classes are dealt with, and nothing eager is.

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
"""
import threading
import traceback
import weakref

import numpy as np
import tensorflow as tf

from sdp.common import errors as _errors
from sdp.common.errors import SdpError
from sdp.tensorflow.errors import graph_status


def _sanitize(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)



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
