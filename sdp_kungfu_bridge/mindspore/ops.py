"""MindSpore operators on sdp: mirrors the KungFu fork's ``mindspore.ops.operations.kungfu_comm_ops``.

Under ``sdprun --compat kungfu`` (or after ``sdp_kungfu_bridge.mindspore.install``) this module
*is* ``mindspore.ops.operations.kungfu_comm_ops``.  Every operator is an
``ops.Custom(fn, out_shape, out_dtype, func_type="pyfunc")``: ``fn`` is Python that hands numpy
arrays to ``sdp.api``, and MindSpore runs it inside ``construct`` in GRAPH and PYNATIVE mode on
CPU, also inside ``C.Map`` in an optimizer inside ``Model.train``.  The fork's primitives ran
KungFu's C++ peer; these run sdp's engine (numpy + ZeroMQ + shared memory).

Operators (shapes and dtypes as the fork's ``infer`` methods)

=========================  ====================================================================
``KungFuAllReduce(op)``    ``x`` -> same shape/dtype, reduced over the cluster; ``op``: ``"sum"``
                           (default, as the fork: gradients are *summed*), ``"max"``, ``"min"``,
                           ``"prod"`` (MindSpore's ``ReduceOp`` names) or an ``sdp`` ReduceOp.
``KungFuAllGather()``      ``x`` -> ``[cluster size] + x.shape``, rank order (the size is read
                           when the op is compiled, as in the fork).
``KungFuBroadcast()``      ``x`` -> rank 0's ``x`` on every rank.
``KungFuResize()``         ``n`` (``uint32`` scalar, the new cluster size) -> ``(changed,
                           detached)`` booleans: a collective, see
                           ``sdp_kungfu_bridge._cluster.resize``.  A bad size (0, more than
                           ``sdprun -w``'s slots) raises on every rank (MindSpore wraps the
                           ``ResizeError`` in a ``RuntimeError``
                           that carries its message, raised where the result is read: PYNATIVE
                           ops run asynchronously).
``KungFuClusterSize()``    no input -> the cluster size (``int32``, shape ``(1,)``: MindSpore gives
                           an input-less pyfunc a 1-element output).
``KungFuLogTensor()``      ``x`` -> ``x``, printed with the rank.
=========================  ====================================================================

Dtypes: float16/32/64, int32/64 (and the others ``sdp.api`` supports).  A 0-d tensor reaches a
pyfunc as a Python scalar, so its collective runs in float64 / int64 and MindSpore casts the
result back to the declared dtype.

Functions: ``init(device)``, ``finalize(device)``, ``KungFuContext(device="CPU")`` (a context
manager calling both), ``using_kungfu()`` (true when a launcher gave this process a cluster:
``sdprun``'s ``SDP_*`` or KungFu's ``KUNGFU_SELF_SPEC``), and the fork's ``_c_expression``
functions ``kungfu_init``, ``kungfu_finalize``, ``kungfu_current_rank``,
``kungfu_current_cluster_size``, ``kungfu_nccl_init``/``kungfu_nccl_finalize`` (no-ops: sdp's
collectives are on host memory; ``device="GPU"`` is accepted).

PYNATIVE subclasses (MindSpore 2.10): ``@jit`` on a Cell's ``construct`` compiles the *object's*
``construct`` by name (``_JitExecutor.compile(obj)`` with ``obj.__parse_method__ = "construct"``).
So a subclass ``construct`` that runs eagerly and then calls ``super().construct(...)`` of a
``@jit`` parent (the guide's ``KungFuMomentum(nn.Momentum)``) is compiled whole and run a second
time, on the values it passed to the parent: every collective in it ran twice (gradients summed
twice).  ``KungFuAllReduce``, ``KungFuGroupAllReduce`` and ``KungFuBroadcast`` see that case when
called eagerly (the nearest ``construct`` frame is the object's own, reads an attribute named
``construct``, and a parent's ``construct`` is ``@jit``): they reduce then with a twin op and leave
one credit, which the compiled re-run's kernel takes to return its input (already the result)
unchanged.  Each request reaches the engine once.  A subclass that calls the ``@jit`` parent only on
some steps leaves credits behind that a later compiled run of the same op instance would take:
call the parent every step.

Matching across ranks: collectives are named from the bridge's per-epoch counter
(``sdp_kungfu_bridge._cluster.next_name``), so every rank must run them in the same order.
MindSpore 2.10 runs pyfunc kernels one at a time on one thread, but in a compiled graph it runs
independent kernels in data-flow order, which varies from step to step (the gradients of
``C.Map(all_reduce, grads)`` came out in a different order on two workers after a resize: a
``TensorMismatchError``).  So every operator carries ``side_effect_io``: MindSpore then orders
them as the program does (``C.Map`` over the gradients: parameter order).  The engine checks
shape and dtype per name (``TensorMismatchError`` on every rank otherwise).
"""
import linecache
import logging
import os
import sys
import threading

import numpy as np
import mindspore as ms
from mindspore import ops

from sdp import api
from sdp.common.reduce_ops import ReduceOp
from sdp_kungfu_bridge import _cluster

log = logging.getLogger("sdp.kungfu.mindspore")

__all__ = ['KungFuAllGather', 'KungFuAllReduce', 'KungFuBroadcast', 'KungFuClusterSize', 'KungFuContext',
           'KungFuGroupAllReduce', 'KungFuLogTensor', 'KungFuResize', 'finalize', 'init', 'using_kungfu']

_OPS = {'sum': ReduceOp.SUM, 'max': ReduceOp.MAX, 'min': ReduceOp.MIN, 'prod': ReduceOp.PRODUCT,
        'avg': ReduceOp.AVERAGE, 'mean': ReduceOp.AVERAGE}


def _reduce_op(op) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    key = str(op).lower()
    if key not in _OPS:
        raise ValueError(f"KungFuAllReduce: unknown op {op!r}; expected one of {sorted(_OPS)}")
    return _OPS[key]


def _as_array(x) -> np.ndarray:
    """A pyfunc input as a contiguous numpy array (0-d tensors arrive as Python scalars)."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    if isinstance(x, (bool, np.bool_)):
        return np.asarray(x, np.bool_)
    if isinstance(x, int):
        return np.asarray(x, np.int64)
    if isinstance(x, float):
        return np.asarray(x, np.float64)
    return np.ascontiguousarray(np.asarray(x))


def _same(x):
    return x


class _KungFuOp(ops.Custom):
    """Base of the operators: an ``ops.Custom`` pyfunc (usable in ``construct``, ``C.Map`` and
    eagerly)."""

    def _setup(self, fn, out_shape, out_dtype):
        ops.Custom.__init__(self, fn, out_shape=out_shape, out_dtype=out_dtype, func_type="pyfunc")
        # Program order in compiled graphs (see "Matching across ranks" in the module docstring).
        self.add_prim_attr("side_effect_io", True)


def _rerun_by_parent_jit(frame) -> bool:
    """Whether the nearest ``Cell.construct`` around ``frame`` will be compiled and run again by
    a ``@jit`` parent (see "PYNATIVE subclasses" in the module docstring): that frame runs the
    object's own ``construct`` (``type(cell).construct``), its code reads an attribute named
    ``construct`` (``super().construct(...)``), and a parent class's ``construct`` is ``@jit``."""
    while frame is not None:
        if frame.f_code.co_name == "construct":
            cell = frame.f_locals.get("self")
            if isinstance(cell, ms.nn.Cell):
                cls = type(cell)
                if getattr(cls.construct, "__code__", None) is not frame.f_code \
                        or "construct" not in frame.f_code.co_names or getattr(cls, "_kungfu_no_rerun", False):
                    return False
                return any(getattr(k.__dict__.get("construct"), "__wrapped_by_jit__", False) for k in cls.__mro__[1:])
        frame = frame.f_back
    return False


class _Rerun:
    """Credits for the compiled re-run: one per eager call made inside a construct that a
    ``@jit`` parent runs again; the re-run's kernel takes one and returns its input."""

    def __init__(self):
        self._credit = 0
        self._lock = threading.Lock()

    def grant(self) -> None:
        with self._lock:
            self._credit += 1

    def take(self) -> bool:
        with self._lock:
            if self._credit:
                self._credit -= 1
                return True
            return False

    @property
    def pending(self) -> int:
        return self._credit


def _never() -> bool:
    return False


class _ReducingOp(_KungFuOp):
    """A collective whose result, fed to it again by the compiled re-run of a PYNATIVE subclass
    ``construct``, must come back unchanged (allreduce, group allreduce, broadcast: their output
    has the input's shapes).  ``make_fn(skip)`` returns the pyfunc; ``skip()`` true means "this
    run is the re-run: return the input"."""

    def _setup_reducing(self, make_fn, out_shape, out_dtype):
        self._kungfu_rerun = _Rerun()
        self._kungfu_make = (make_fn, out_shape, out_dtype)
        self._kungfu_twin = None
        self._setup(make_fn(self._kungfu_rerun.take), out_shape, out_dtype)

    def __call__(self, *args):
        if not _pynative() or not _rerun_by_parent_jit(sys._getframe(1)):
            return super().__call__(*args)
        # The eager call of a construct that a @jit parent runs again: reduce now with a twin
        # op (its kernel never skips), and let this op's kernel skip once in the re-run.
        self._kungfu_rerun.grant()
        if self._kungfu_twin is None:
            make_fn, out_shape, out_dtype = self._kungfu_make
            twin = _KungFuOp(make_fn(_never), out_shape=out_shape, out_dtype=out_dtype, func_type="pyfunc")
            twin.add_prim_attr("side_effect_io", True)
            self._kungfu_twin = twin
        return self._kungfu_twin(*args)


def _pynative() -> bool:
    return ms.get_context("mode") == ms.PYNATIVE_MODE


class KungFuAllReduce(_ReducingOp):
    """``y = allreduce(x, op)`` over the cluster (default ``op="sum"``, as the fork)."""

    def __init__(self, op='sum'):
        reduce_op = _reduce_op(op)

        def make(skip):
            def kungfu_all_reduce(x):
                if skip():
                    return _as_array(x)
                _cluster.ensure()
                return api.allreduce(_as_array(x), name=_cluster.next_name("ms.all_reduce"), op=reduce_op)
            return kungfu_all_reduce

        self._setup_reducing(make, _same, _same)


class KungFuAllGather(_KungFuOp):
    """``y[r] = x`` of rank ``r``: shape ``[cluster size] + x.shape``.

    A 0-d ``x`` reaches the pyfunc as a Python scalar without its dtype, and MindSpore casts only
    0-d results; so the dtype of the latest 0-d input inferred for this op is used for its
    result (one op instance per 0-d dtype inside one compiled graph)."""

    def __init__(self):
        scalar_dtype = {"np": None, "shape": None}

        def kungfu_all_gather(x):
            _cluster.ensure()
            a = _as_array(x)
            if a.ndim == 0 and scalar_dtype["np"] is not None:
                a = a.astype(scalar_dtype["np"])
            return api.allgather(a.reshape((1,) + a.shape), name=_cluster.next_name("ms.all_gather"))

        def shape(x):
            scalar_dtype["shape"] = tuple(x)
            return [_cluster.size()] + list(x)

        def dtype(d):
            if scalar_dtype["shape"] == ():
                scalar_dtype["np"] = ms.dtype_to_nptype(d.element_type() if hasattr(d, "element_type") else d)
            return d

        self._setup(kungfu_all_gather, shape, dtype)


class KungFuBroadcast(_ReducingOp):
    """``y = x`` of rank 0."""

    def __init__(self):
        def make(skip):
            def kungfu_broadcast(x):
                if skip():
                    return _as_array(x)
                _cluster.ensure()
                return api.broadcast(_as_array(x), 0, name=_cluster.next_name("ms.broadcast"))
            return kungfu_broadcast

        self._setup_reducing(make, _same, _same)


class KungFuResize(_KungFuOp):
    """``changed, detached = resize(n)``: resize the cluster to ``n`` workers (``uint32`` scalar)."""

    def __init__(self):
        def kungfu_resize(n):
            changed, detached = _cluster.resize(int(n))
            return np.asarray(changed, np.bool_), np.asarray(detached, np.bool_)

        self._setup(kungfu_resize, lambda n: ((), ()), lambda n: (ms.bool_, ms.bool_))


class KungFuClusterSize(_KungFuOp):
    """``size = cluster_size()`` (no input; ``int32``)."""

    def __init__(self):
        def kungfu_cluster_size():
            return np.asarray([_cluster.size()], np.int32)

        self._setup(kungfu_cluster_size, (1,), ms.int32)


class KungFuLogTensor(_KungFuOp):
    """``y = x``; prints ``x`` with this worker's rank."""

    def __init__(self):
        def kungfu_log_tensor(x):
            a = _as_array(x)
            print(f"[kungfu rank {_cluster.rank()}] {a.dtype}{list(a.shape)} {a}", flush=True)
            return a

        self._setup(kungfu_log_tensor, _same, _same)


_group_lock = threading.Lock()


def _fixed_arity(n: int, impl):
    """A function of exactly ``n`` positional parameters calling ``impl(tuple)``: a pyfunc with
    ``*args`` counts as one tuple input, which MindSpore 2.10 refuses.  Its source is put in
    ``linecache`` because ``ops.Custom`` reads the function's source."""
    params = ", ".join(f"x{i}" for i in range(n))
    src = f"def kungfu_group_all_reduce_{n}({params}):\n    return _impl(({params}{',' if n == 1 else ''}))\n"
    filename = f"<sdp-kungfu-group-all-reduce-{n}-{id(impl):x}>"
    with _group_lock:
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    namespace = {"_impl": impl}
    exec(compile(src, filename, "exec"), namespace)  # noqa: S102 - our own fixed template
    return namespace[f"kungfu_group_all_reduce_{n}"]


class KungFuGroupAllReduce(_ReducingOp):
    """``ys = allreduce(*xs)`` of ``n`` tensors as one request: the engine fuses the tensors of
    one dtype into one collective (``SDP_FUSION_THRESHOLD`` buckets).  Not in the fork (its
    optimizers allreduce each gradient); used by the grouped optimizers.  Call as
    ``op(*tensors)``; returns a tuple."""

    def __init__(self, n: int, op='sum'):
        n = int(n)
        if n < 1:
            raise ValueError(f"KungFuGroupAllReduce needs at least one tensor, got n={n}")
        reduce_op = _reduce_op(op)

        def make(skip):
            def impl(xs):
                if skip():
                    return tuple(_as_array(x) for x in xs)
                _cluster.ensure()
                base = _cluster.next_name("ms.group_all_reduce")
                return tuple(api.grouped_allreduce([_as_array(x) for x in xs], name=base, op=reduce_op))
            return _fixed_arity(n, impl)

        self._setup_reducing(make, lambda *s: tuple(s), lambda *d: tuple(d))


# ------------------------------------------------------------------ the fork's functions


def kungfu_init():
    """Join the cluster (idempotent; ``_c_expression.kungfu_init`` of the fork)."""
    _cluster.init()


def kungfu_finalize():
    """Leave the cluster (idempotent)."""
    _cluster.finalize()


def kungfu_current_rank() -> int:
    return _cluster.rank()


def kungfu_current_cluster_size() -> int:
    return _cluster.size()


def kungfu_nccl_init():
    """No-op: sdp's collectives work on host memory (the fork set up NCCL here)."""


def kungfu_nccl_finalize():
    """No-op (see ``kungfu_nccl_init``)."""


_DEVICES = ('CPU', 'GPU')


def _check_device(device):
    if device not in _DEVICES:
        raise RuntimeError('invalid device %s' % (device,))


def init(device='CPU'):
    """Join the cluster; ``device`` is ``"CPU"`` or ``"GPU"`` (the latter: no NCCL, see above)."""
    _check_device(device)
    kungfu_init()
    if device == 'GPU':
        kungfu_nccl_init()


def finalize(device='CPU'):
    """Leave the cluster."""
    _check_device(device)
    if device == 'GPU':
        kungfu_nccl_finalize()
    kungfu_finalize()


class KungFuContext:
    """``with KungFuContext(device="CPU"): ...`` joins the cluster on entry, leaves on exit.
    Raises ``RuntimeError`` for a device other than CPU/GPU."""

    def __init__(self, device='CPU'):
        _check_device(device)
        self._device = device

    def __enter__(self):
        init(self._device)
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        finalize(self._device)


def using_kungfu() -> bool:
    """Whether a launcher gave this process a cluster (``sdprun`` or ``kungfu-run``)."""
    return bool(os.environ.get('KUNGFU_SELF_SPEC') or os.environ.get('SDP_RENDEZVOUS_ADDR')
                or os.environ.get('SDP_SIZE'))
