"""TensorFlow operators on sdp: mirrors ``kungfu.tensorflow.ops``.

Every operator hands numpy arrays to ``sdp.api`` (collectives) or to the bridge's model store
(``save_variable``/``request_variable``) through ``sdp.tensorflow.ops.run_numpy``, so they run
eagerly, inside ``tf.function`` and in ``tf.compat.v1`` graphs/sessions.  In graphs the
collectives that return tensors (``all_reduce``, ``group_all_reduce``, ``broadcast``,
``all_gather``, ``consensus``) hold no inter-op thread while they wait for peers (a submit op
and an asynchronous wait op, as KungFu's own ``AsyncOpKernel`` ops), so independent collectives
built in a different order on each worker finish even with one inter-op thread; ``barrier()``,
which has no output, is one blocking ``tf.py_function``.  Operators read the cluster when they
run, not when they are built, so a traced function stays correct after ``resize``.

Collectives are matched across workers by name: eagerly, names come from a per-epoch counter
(every worker issues the same eager calls in the same order); in graphs, from the graph's unique
op names at trace time (every worker traces the same program).

Differences from KungFu, by design: ``all_reduce``/``group_all_reduce`` of a list run as one
fused operation; ``barrier()``/``save_variable()`` return the operation in graphs and ``None``
eagerly; ``global_noise_scale`` keeps its moving averages in Python.
"""
import hashlib
import random
import threading

import numpy as np
import tensorflow as tf

from sdp import api
from sdp.common.reduce_ops import ReduceOp
from sdp.tensorflow.ops import run_numpy
from sdp_kungfu_bridge import _cluster, _model_store
from sdp_kungfu_bridge.python import (_get_other_ranks, current_cluster_size,  # noqa: F401
                                      current_local_rank, current_local_size, current_rank,
                                      run_barrier)

__all__ = [
    'all_gather',
    'all_reduce',
    'barrier',
    'broadcast',
    'consensus',
    'counter',
    'global_noise_scale',
    'group_all_reduce',
    'peer_info',
    'request_variable',
    'request_variable_with_template',
    'resize',
    'resize_cluster_from_url',
    'save_variable',
    'save_variables',
    'step_based_schedule',
]

_OPS = {'sum': ReduceOp.SUM, 'min': ReduceOp.MIN, 'max': ReduceOp.MAX, 'prod': ReduceOp.PRODUCT,
        'avg': ReduceOp.AVERAGE, 'mean': ReduceOp.AVERAGE}


# ------------------------------------------------------------------------------------ plumbing


def collective_name(kind: str) -> str:
    """A name for a collective built now (see the module docstring)."""
    if tf.executing_eagerly():
        _cluster.ensure()
        return _cluster.next_name(kind)
    g = tf.compat.v1.get_default_graph()
    return f"kf.{kind}.g.{g.unique_name('kf_' + kind, mark_as_used=True)}"


def _tensor(t):
    if t is None:
        return None
    if isinstance(t, tf.IndexedSlices):
        return tf.convert_to_tensor(t)
    return tf.convert_to_tensor(t)


def py_op(fn, inputs, out_dtypes, out_shapes, name, blocking=False):
    """Run ``fn(*numpy arrays) -> list of arrays`` as a TensorFlow op on the current cluster
    (see ``sdp.tensorflow.ops.run_numpy``; ``blocking=True`` when ``fn`` waits for peers)."""
    def call(arrays):
        _cluster.ensure()
        return fn(*arrays)

    return run_numpy(call, inputs, out_dtypes, out_shapes, name, blocking=blocking)


def _done(op):
    """What side-effect operators return: the operation in graphs, None eagerly."""
    return None if tf.executing_eagerly() else op


def grouped_allreduce(tensors, names, op=ReduceOp.SUM):
    """Allreduce a list of tensors (no ``None``) as one operation; same shapes and dtypes out."""
    tensors = [_tensor(t) for t in tensors]
    if not tensors:
        return []

    def fn(*arrays):  # (one group, run whole in this thread by the fast lane where it can: sdp.api)
        return api.grouped_allreduce_named(list(arrays), names, op)

    return py_op(fn, tensors, [t.dtype for t in tensors], [t.shape for t in tensors], names[0], blocking=True)


def grouped_broadcast(tensors, names, root_rank=0):
    """Broadcast a list of tensors from ``root_rank`` as one operation."""
    tensors = [_tensor(t) for t in tensors]
    if not tensors:
        return []

    def fn(*arrays):
        hs = [api.broadcast_async(a, root_rank, n) for a, n in zip(arrays, names)]
        return [h.wait() for h in hs]

    return py_op(fn, tensors, [t.dtype for t in tensors], [t.shape for t in tensors], names[0], blocking=True)


def assign(variable, value):
    """``variable.assign(value)`` that returns the assign operation in graphs (tf variables) or
    whatever the variable returns (Keras variables; ordered by ``tf.function`` itself)."""
    if isinstance(variable, tf.Variable):
        return variable.assign(value, read_value=False)
    return variable.assign(value)


def _map_maybe(f, xs):
    return [None if x is None else f(x) for x in xs]


# --------------------------------------------------------------------------------- collectives


def barrier():
    """Create a new barrier operator: it completes once every peer has run it."""
    name = collective_name("barrier")

    def fn():
        api.allreduce(np.zeros(1, np.int32), name, ReduceOp.SUM)
        return []

    return _done(py_op(fn, [], [], [], name))


def consensus(t):
    """A bool scalar: whether every peer holds the same value (dtype, shape and content) of ``t``."""
    t = _tensor(t)
    name = collective_name("consensus")

    def fn(a):
        digest = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode() + a.tobytes()).hexdigest()
        return [np.array(len(set(api.allgather_object(digest, name))) == 1)]

    return py_op(fn, [t], [tf.bool], [tf.TensorShape([])], name, blocking=True)[0]


def broadcast(t):
    """Create a new broadcast operator for given tensor: rank 0's value on every peer."""
    t = _tensor(t)
    return grouped_broadcast([t], [collective_name("broadcast")], 0)[0]


def all_reduce(t, op='sum'):
    """Create a new all_reduce operator for given tensor.  ``op``: ``'sum'`` (default),
    ``'min'``, ``'max'``, ``'prod'`` (``'avg'`` is an sdp extension)."""
    try:
        rop = _OPS[str(op).lower()]
    except KeyError:
        raise ValueError(f"unknown all_reduce op {op!r}; expected one of {sorted(_OPS)}") from None
    return grouped_allreduce([t], [collective_name("all_reduce")], rop)[0]


def group_all_reduce(ts):
    """Create a list of all_reduce (sum) operators for given tensor list (``None`` entries stay
    ``None``).  The tensors are reduced in one fused operation."""
    ts = list(ts)
    idx = [i for i, t in enumerate(ts) if t is not None]
    base = collective_name("group_all_reduce")
    reduced = grouped_allreduce([ts[i] for i in idx], [f"{base}.{i}" for i in idx], ReduceOp.SUM)
    out = [None] * len(ts)
    for i, r in zip(idx, reduced):
        out[i] = r
    return out


def group_nccl_all_reduce(ts):
    """``group_all_reduce`` (KungFu's NCCL variant; sdp reduces on the host)."""
    return group_all_reduce(ts)


def all_gather(t):
    """Create a new all_gather operator for given tensor.

    The shape must be the same on all peers.  Returns a tensor whose leading dimension is the
    number of peers, followed by the original shape."""
    t = _tensor(t)
    name = collective_name("all_gather")
    shape = tf.TensorShape([None]).concatenate(t.shape)
    return py_op(lambda a: [api.allgather(a[np.newaxis], name)], [t], [t.dtype], [shape], name, blocking=True)[0]


def peer_info():
    """A pair of int32 scalars ``(rank, cluster_size)``, read when the operator runs."""
    outs = py_op(lambda: [np.int32(api.rank()), np.int32(api.size())], [], [tf.int32, tf.int32],
                 [tf.TensorShape([])] * 2, "kf_peer_info")
    return outs[0], outs[1]


def rank():
    """An int32 scalar: the rank of this peer."""
    return peer_info()[0]


def cluster_size():
    """An int32 scalar: the number of peers in the cluster."""
    return peer_info()[1]


# ------------------------------------------------------------------------------------- elastic


def resize(n):
    """Resize the cluster to ``n`` (a scalar tensor or int).  Returns a bool scalar: whether the
    cluster changed; ``sdp_kungfu_bridge.python.detached`` tells whether this peer left."""
    n = tf.cast(_tensor(n), tf.int64)
    return py_op(lambda v: [np.array(_cluster.resize(int(v))[0])], [n], [tf.bool],
                 [tf.TensorShape([])], "kf_resize")[0]


def resize_cluster_from_url():
    """Resize the cluster to the config server's size.  Returns a pair of bool scalars
    ``(changed, detached)``; a detached peer should quit."""
    outs = py_op(lambda: [np.array(x) for x in _cluster.resize(None)], [], [tf.bool, tf.bool],
                 [tf.TensorShape([])] * 2, "kf_resize_from_url")
    return outs[0], outs[1]


def counter(init=None, incr=None, debug=False):
    """A stateful int32 scalar: ``init`` the first time the operator runs, then ``+ incr`` at
    every run (defaults 0 and 1).  Each call creates an independent counter."""
    state = {"next": 0 if init is None else int(init)}
    step = 1 if incr is None else int(incr)
    lock = threading.Lock()

    def fn():
        with lock:
            v = state["next"]
            state["next"] += step
        if debug:
            print(f"counter: {v}", flush=True)
        return [np.int32(v)]

    return py_op(fn, [], [tf.int32], [tf.TensorShape([])], "kf_counter")[0]


def parse_schedule(config: str):
    """``'size:steps,size:steps,...'`` -> list of ((begin, end), size).  Raises ValueError."""
    if not config:
        raise ValueError("config can't be empty")
    stages, offset = [], 0
    for part in filter(None, config.split(",")):
        kv = part.split(":")
        if len(kv) != 2:
            raise ValueError(f"invalid schedule config {config!r}: expected 'size:steps,...'")
        size, steps = int(kv[0]), int(kv[1])
        stages.append(((offset, offset + steps), size))
        offset += steps
    return stages


def schedule_size(stages, step: int, default: int = 1) -> int:
    """The cluster size that ``stages`` (``[((begin, end), size), ...]`` from ``parse_schedule``
    of a schedule such as ``"2:100,4:200"``: 2 workers for steps 0-99, then 4) gives ``step``;
    ``default`` outside every stage."""
    for (lo, hi), size in stages:
        if lo <= step < hi:
            return size
    return default


def step_based_schedule(config, step=None):
    """The cluster size that ``config`` (``'size:steps,size:steps,...'``, e.g. ``'1:3,2:3'``:
    size 1 for steps 0-2, size 2 for steps 3-5) gives for ``step`` (default: a new
    ``counter``), as an int32 scalar; 1 after the last stage."""
    stages = parse_schedule(config)
    if step is None:
        step = counter()
    step = tf.cast(_tensor(step), tf.int32)
    return py_op(lambda s: [np.int32(schedule_size(stages, int(s)))], [step], [tf.int32],
                 [tf.TensorShape([])], "kf_step_based_schedule")[0]


# ------------------------------------------------------------------------------- model store


def _var_name(t, name):
    if name:
        return name
    for attr in ("path", "name"):
        try:
            value = getattr(t, attr, None)
        except (AttributeError, ValueError):
            value = None
        if value:
            return value
    raise ValueError("name is required (this tensor has no name)")


def save_variable(t, version=None, name=None):
    """Save ``t`` under ``name`` (default: the variable's name) in this peer's model store,
    from which other peers can ``request_variable`` it at any time.  ``version``: an int64
    scalar; the last few versions are kept besides the latest."""
    name = _var_name(t, name)
    t = _tensor(t)
    if version is None:
        op = py_op(lambda a: (_model_store.save(name, a), [])[1], [t], [], [], "kf_save_variable")
    else:
        v = tf.cast(_tensor(version), tf.int64)
        op = py_op(lambda a, ver: (_model_store.save(name, a, int(ver)), [])[1], [t, v], [], [],
                   "kf_save_variable")
    return _done(op)


def save_variables(variables):
    """Save each variable under its name (see ``save_variable``)."""
    ops = [save_variable(v) for v in variables]
    return None if tf.executing_eagerly() else tf.group(ops)


def request_variable(target, version=None, name=None, shape=None, dtype=None):
    """Pull the variable saved as ``name`` from peer ``target`` (an int32 scalar rank) without
    the peer taking part.  ``shape`` and ``dtype`` are required; ``version``: an int64 scalar
    (default: the latest).  Raises ``StoreError``/``StoreTimeoutError`` when it runs."""
    if name is None:
        raise RuntimeError('name is required')
    if shape is None:
        raise RuntimeError('shape is required')
    if dtype is None:
        raise RuntimeError('dtype is required')
    shape, dtype = tf.TensorShape(shape), tf.as_dtype(dtype)
    target = tf.cast(_tensor(target), tf.int32)

    def fn(tgt, *ver):
        arr = _model_store.request(int(tgt), name, int(ver[0]) if ver else None)
        if tuple(arr.shape) != tuple(shape.as_list()):
            raise _model_store.StoreError(
                f"request_variable({name!r}): peer {int(tgt)} has shape {list(arr.shape)}, "
                f"expected {shape.as_list()}")
        return [arr]

    inputs = [target] if version is None else [target, tf.cast(_tensor(version), tf.int64)]
    return py_op(fn, inputs, [dtype], [shape], "kf_request_variable")[0]


def request_variable_with_template(target, template, version=None):
    """``request_variable`` with name, shape and dtype taken from ``template``."""
    return request_variable(target, version=version, name=_var_name(template, None),
                            shape=template.shape, dtype=template.dtype)


# ---------------------------------------------------------------------------------- monitoring


class NoiseScaleEstimator:
    """Gradient noise scale from a small-batch and a big-batch gradient ("An Empirical Model of
    Large-Batch Training", McCandlish et al. 2018, appendix A), with exponential moving averages.

    With ``|G_s|^2``, ``|G_b|^2`` the squared norms of gradients over ``B_s`` and ``B_b``
    examples: ``|G|^2 ~ (B_b |G_b|^2 - B_s |G_s|^2) / (B_b - B_s)`` and
    ``S ~ (|G_s|^2 - |G_b|^2) / (1/B_s - 1/B_b)``.  Both are smoothed (``ema = alpha * ema +
    (1 - alpha) * new``, the first value taken as is) and the estimate is ``B_noise = S / |G|^2``.
    NaN when ``B_b <= B_s`` (one worker)."""

    def __init__(self, alpha=0.6):
        self.alpha = float(alpha)
        self.g2 = None
        self.s = None
        self.value = float("nan")
        self._lock = threading.Lock()

    def update(self, batch_small, batch_big, small_grad, big_grad) -> float:
        b_s, b_b = float(batch_small), float(batch_big)
        if b_b <= b_s:
            return float("nan")
        gs2 = float(np.sum(np.square(np.asarray(small_grad, np.float64))))
        gb2 = float(np.sum(np.square(np.asarray(big_grad, np.float64))))
        g2 = (b_b * gb2 - b_s * gs2) / (b_b - b_s)
        s = (gs2 - gb2) / (1.0 / b_s - 1.0 / b_b)
        with self._lock:
            if self.g2 is None:
                self.g2, self.s = g2, s
            else:
                self.g2 = self.alpha * self.g2 + (1 - self.alpha) * g2
                self.s = self.alpha * self.s + (1 - self.alpha) * s
            self.value = self.s / self.g2 if self.g2 != 0 else float("nan")
            return self.value


def global_noise_scale(batch_small, batch_big, tensor, avg_tensor, alpha=0.6):
    """A float32 scalar: the gradient noise scale estimated from ``tensor`` (a gradient over
    ``batch_small`` examples, e.g. this worker's) and ``avg_tensor`` (the gradient over
    ``batch_big`` examples, e.g. averaged over all workers), smoothed with ``alpha``; see
    ``NoiseScaleEstimator``.  Each call creates an independent estimator."""
    est = NoiseScaleEstimator(alpha)
    ins = [tf.cast(_tensor(batch_small), tf.float64), tf.cast(_tensor(batch_big), tf.float64),
           _tensor(tensor), _tensor(avg_tensor)]
    return py_op(lambda bs, bb, g, a: [np.float32(est.update(bs, bb, g, a))], ins, [tf.float32],
                 [tf.TensorShape([])], "kf_global_noise_scale")[0]


# ------------------------------------------------------------------------------------- helpers


def fuse(ts):
    """Concatenate the flattened tensors into one vector."""
    return tf.concat([tf.reshape(t, [-1]) for t in ts], -1)


def defuse(y, shapes):
    """Split a vector made by ``fuse`` back into tensors of ``shapes``."""
    ts, off = [], 0
    for s in shapes:
        s = tf.TensorShape(s)
        n = s.num_elements()
        ts.append(tf.reshape(tf.slice(y, [off], [n]), s))
        off += n
    if y.shape.num_elements() is not None and off != y.shape.num_elements():
        raise RuntimeError('invalid shapes')
    return ts


def random_peer(rng: random.Random = random) -> int:
    """A rank other than this one, uniformly (this rank when alone)."""
    n, me = api.size(), api.rank()
    if n == 1:
        return me
    t = rng.randrange(n - 1)
    return t + 1 if t >= me else t
