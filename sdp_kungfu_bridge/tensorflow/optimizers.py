"""Distributed optimizers on sdp: mirrors ``kungfu.tensorflow.optimizers``.

Each function wraps an optimizer and returns one that runs a distributed algorithm in
``apply_gradients``:

* a Keras 3 optimizer (``tf.keras.optimizers.*`` / ``keras.optimizers.*``) becomes an instance of
  a subclass of its own class, built from its config, whose ``apply`` (and so ``apply_gradients``,
  ``model.fit``) runs the algorithm; it is still a Keras optimizer (``model.compile``, checkpoints).
  Its ``variables`` can also be called, as KungFu examples do (``opt.variables()``);
* a ``tf.compat.v1.train.Optimizer`` becomes a ``tf.compat.v1.train.Optimizer`` that delegates to
  it (``compute_gradients``, ``get_slot``, ``variables``) and runs the algorithm in
  ``apply_gradients`` (and so ``minimize``), eagerly, in ``tf.function`` and in sessions.

``with_keras`` (KungFu: the optimizer comes from the standalone ``keras`` package) is accepted;
with Keras 3, ``keras`` and ``tf.keras`` are the same, so it changes nothing.  ``name`` and
``use_locking`` are passed to v1 optimizers; ``nccl``/``nccl_fusion`` are accepted and ignored
(sdp reduces on the host and always fuses).  v1 optimizers also accept Keras 3 model variables
(the ``tf.Variable`` behind each is updated), as KungFu's TF2 example pairs
``tf.compat.v1.train.AdamOptimizer`` with a Keras model.

Averages are computed with the cluster size at run time, so a wrapped optimizer stays correct
after an elastic ``resize``.
"""
import itertools
import logging
import random
import threading

import numpy as np
import tensorflow as tf

from sdp import api
from sdp.common.reduce_ops import ReduceOp
from sdp.tensorflow.optimizer import WrappedLegacyOptimizer
from sdp_kungfu_bridge import _cluster, _model_store
from sdp_kungfu_bridge.tensorflow import ops as _ops

log = logging.getLogger("sdp.kungfu")

__all__ = [
    'MonitorGradientNoiseScaleOptimizer',
    'PairAveragingOptimizer',
    'SynchronousAveragingOptimizer',
    'SynchronousSGDOptimizer',
]

_ids = itertools.count()


def _read(v):
    """The current value of a (tf or Keras) variable as a tensor."""
    return tf.convert_to_tensor(v)


def _deps(xs):
    """The graph ops/tensors among ``xs`` (Keras assigns return values, eager ones nothing)."""
    return [x for x in xs if isinstance(x, (tf.Operation, tf.Tensor)) and not tf.executing_eagerly()]


def _group(*xs):
    deps = _deps(xs)
    return tf.group(*deps) if deps else None


# ---------------------------------------------------------------------------------- algorithms


class _Algorithm:
    """``apply(local_apply, grads, variables)``: the distributed step; ``local_apply(grads,
    variables)`` applies gradients with the wrapped optimizer and returns its op (or None)."""

    kind = "algo"

    def __init__(self):
        self.base = f"kf.{self.kind}.{next(_ids)}"

    def apply(self, local_apply, grads, variables):
        raise NotImplementedError

    def _reduce(self, grads, op=ReduceOp.AVERAGE):
        idx = [i for i, g in enumerate(grads) if g is not None]
        reduced = _ops.grouped_allreduce([grads[i] for i in idx], [f"{self.base}.{i}" for i in idx], op)
        out = list(grads)
        for i, r in zip(idx, reduced):
            out[i] = r
        return out


class _SynchronousSGD(_Algorithm):
    """S-SGD: gradients are averaged over all workers, then applied (Horovod's DistributedOptimizer)."""
    kind = "ssgd"

    def apply(self, local_apply, grads, variables):
        return local_apply(self._reduce(grads), variables)


class _SynchronousAveraging(_Algorithm):
    """SMA: the models are averaged over all workers, then each applies its local gradients."""
    kind = "sma"

    def apply(self, local_apply, grads, variables):
        avg = self._reduce([_read(v) for v in variables])
        assigns = [_ops.assign(v, a) for v, a in zip(variables, avg)]
        with tf.control_dependencies(_deps(assigns)):
            return local_apply(grads, variables)


def _fuse_bytes(arrays):
    return np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]) \
        if arrays else np.zeros(0, np.uint8)


def _defuse_bytes(buf, like):
    out, off = [], 0
    for a in like:
        n = a.nbytes
        out.append(buf[off:off + n].view(a.dtype).reshape(a.shape))
        off += n
    if off != buf.size:
        raise _model_store.StoreError(f"peer model has {buf.size} bytes, this model {off}: different models?")
    return out


class _PairAveraging(_Algorithm):
    """AD-PSGD: pull the latest model of one random peer from its store, average with it, apply
    local gradients, save the new model to the own store.  Peers serve their store from a
    background thread, so nobody waits for a peer's training step."""
    kind = "pair_avg"

    def __init__(self, fuse_requests=True, model_name=None):
        super().__init__()
        self.fuse_requests = fuse_requests
        self.model_name = f"{self.base}.{model_name or 'model'}"
        self._store_epoch = None
        self._rng = random.Random(_cluster.uid())
        self._lock = threading.Lock()
        self.pulls = 0

    def _save(self, arrays):
        if self.fuse_requests:
            _model_store.save(self.model_name, _fuse_bytes(arrays))
        else:
            for i, a in enumerate(arrays):
                _model_store.save(f"{self.model_name}.{i}", a)

    def _init_store(self, arrays):
        """First step of an epoch (a collective): save the model, then wait until every peer has."""
        ep = _cluster.epoch()
        if self._store_epoch != ep:
            self._save(arrays)
            api.allreduce(np.zeros(1, np.int32), f"{self.base}.init.{ep}", ReduceOp.SUM)
            self._store_epoch = ep

    def _average(self, *arrays):
        with self._lock:
            self._init_store(arrays)
            if api.size() == 1:
                return list(arrays)
            target = _ops.random_peer(self._rng)
            if self.fuse_requests:
                other = _defuse_bytes(_model_store.request(target, self.model_name), arrays)
            else:
                other = [_model_store.request(target, f"{self.model_name}.{i}") for i in range(len(arrays))]
            self.pulls += 1
            return [((a + b) * 0.5).astype(a.dtype, copy=False) if a.dtype.kind in "fc" else a
                    for a, b in zip(arrays, other)]

    def apply(self, local_apply, grads, variables):
        values = [_read(v) for v in variables]
        avg = _ops.py_op(self._average, values, [v.dtype for v in values], [v.shape for v in values],
                         f"{self.base}.average")
        assigns = [_ops.assign(v, a) for v, a in zip(variables, avg)]
        with tf.control_dependencies(_deps(assigns)):
            applied = local_apply(grads, variables)
        with tf.control_dependencies(_deps([applied])):
            new = [_read(v) for v in variables]
            saved = _ops.py_op(lambda *arrays: (self._save(arrays), [])[1], new, [], [], f"{self.base}.save")
        return _group(applied, saved)


class _GradientNoiseScale(_SynchronousSGD):
    """S-SGD that also estimates the gradient noise scale every ``monitor_interval`` steps."""
    kind = "gns"

    def __init__(self, device_batch_size, monitor_interval=1, alpha=0.9, verbose=True):
        super().__init__()
        self.device_batch_size = float(device_batch_size)
        self.interval = max(1, int(monitor_interval))
        self.verbose = verbose
        self.estimator = _ops.NoiseScaleEstimator(alpha)
        self.step = 0

    def _monitor(self, n, *arrays):
        step, self.step = self.step, self.step + 1
        if step % self.interval:
            return [np.float32(self.estimator.value)]
        half = len(arrays) // 2
        local = _fuse(arrays[:half])
        reduced = _fuse(arrays[half:])
        b = self.device_batch_size
        value = self.estimator.update(b, b * int(n), local, reduced)
        if self.verbose and api.rank() == 0:
            print(f"Gradient Noise Scale: {value}", flush=True)
        return [np.float32(value)]

    def apply(self, local_apply, grads, variables):
        reduced = self._reduce(grads)
        idx = [i for i, g in enumerate(grads) if g is not None]
        ins = [_ops._tensor(grads[i]) for i in idx] + [reduced[i] for i in idx]
        size = _ops.cluster_size()
        mon = _ops.py_op(self._monitor, [size] + ins, [tf.float32], [tf.TensorShape([])], f"{self.base}.monitor")
        with tf.control_dependencies(_deps(mon)):
            return local_apply(reduced, variables)

    @property
    def noise_scale(self) -> float:
        return self.estimator.value


def _fuse(arrays):
    return np.concatenate([np.asarray(a, np.float64).reshape(-1) for a in arrays]) if arrays else np.zeros(0)


# ------------------------------------------------------------------------------------ wrappers


class _CallableList(list):
    """A list that can also be called (returns a copy of itself): Keras 3 makes
    ``optimizer.variables`` a property, KungFu examples call ``opt.variables()``."""

    def __call__(self):
        return list(self)


class _KerasWrapped:
    """Mixin placed before a Keras optimizer class: ``apply`` runs the KungFu algorithm."""

    def apply(self, grads, trainable_variables=None):
        algo = self.__dict__.get("_kf_algo")
        base = super()
        if algo is None:
            return base.apply(grads, trainable_variables)
        if trainable_variables is None:
            if not self.built:
                return base.apply(grads, trainable_variables)  # Keras raises its own error
            trainable_variables = self._trainable_variables
        grads, variables = list(grads), list(trainable_variables)
        return algo.apply(lambda g, v: base.apply(g, v), grads, variables)

    @property
    def variables(self):
        return _CallableList(super().variables)

    @property
    def kungfu_algorithm(self):
        return self.__dict__.get("_kf_algo")


_keras_classes = {}


def _keras_optimizer_class():
    try:
        import keras
        return keras.optimizers.Optimizer
    except ImportError:  # pragma: no cover - Keras ships with TensorFlow >= 2.16
        return None


def _wrap_keras(optimizer, algo):
    base = type(optimizer)
    cls = _keras_classes.get(base)
    if cls is None:
        # Same name and module as the original, so saved models reload as the plain optimizer.
        cls = type(base.__name__, (_KerasWrapped, base), {"__module__": base.__module__,
                                                          "__qualname__": base.__qualname__})
        _keras_classes[base] = cls
    new = cls.from_config(optimizer.get_config())
    new.__dict__["_kf_algo"] = algo
    return new


def _tf_variable(v):
    """The ``tf.Variable`` behind a Keras 3 variable (v1 optimizers only take tf variables, and
    KungFu's examples pair ``tf.compat.v1.train`` optimizers with Keras models)."""
    if not isinstance(v, tf.Variable):
        inner = getattr(v, "value", None)
        if isinstance(inner, tf.Variable):
            return inner
    return v


class _KungFuV1Optimizer(WrappedLegacyOptimizer):
    """A ``tf.compat.v1.train.Optimizer`` running a KungFu algorithm around another one."""

    def __init__(self, optimizer, algo, name=None, use_locking=False):
        super().__init__(optimizer, name or f"KungFu{type(optimizer).__name__}", use_locking)
        self._kf_algo = algo

    @property
    def kungfu_algorithm(self):
        return self._kf_algo

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        pairs = list(grads_and_vars)
        grads = [g for g, _ in pairs]
        variables = [_tf_variable(v) for _, v in pairs]

        def local_apply(g, v):
            return self._optimizer.apply_gradients(zip(g, v), global_step=global_step, name=name)

        return self._kf_algo.apply(local_apply, grads, variables)


def _create(optimizer, algo, name=None, use_locking=False):
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return _KungFuV1Optimizer(optimizer, algo, name, use_locking)
    keras_base = _keras_optimizer_class()
    if keras_base is not None and isinstance(optimizer, keras_base):
        return _wrap_keras(optimizer, algo)
    raise TypeError(f"Cannot wrap type {type(optimizer).__name__}: expected a tf.compat.v1.train.Optimizer "
                    "or a Keras optimizer")


def _optimizer_name(optimizer) -> str:
    if hasattr(optimizer, "get_name"):
        return optimizer.get_name()
    try:
        return str(optimizer.get_config()["name"])
    except Exception:  # noqa: BLE001
        return type(optimizer).__name__


# ---------------------------------------------------------------------------------- public API


def SynchronousSGDOptimizer(optimizer, nccl=False, nccl_fusion=True, name=None, use_locking=False,
                            with_keras=False):
    """SynchronousSGDOptimizer implements the S-SGD algorithm ("Accurate, Large Minibatch SGD:
    Training ImageNet in 1 Hour", 2017): every step, the gradients are averaged over all workers
    before they are applied, so the model replicas stay identical.  Equivalent to Horovod's
    DistributedOptimizer.

    Arguments: ``optimizer`` (``tf.compat.v1.train.Optimizer`` or Keras optimizer).
    Keyword arguments: ``nccl``, ``nccl_fusion`` (accepted, ignored), ``name``, ``use_locking``
    (v1 optimizers), ``with_keras`` (accepted).  Raises ``TypeError`` for other objects."""
    _cluster.ensure()
    return _create(optimizer, _SynchronousSGD(), name, use_locking)


def SynchronousAveragingOptimizer(optimizer, name=None, use_locking=False, with_keras=False):
    """SynchronousAveragingOptimizer implements the SMA algorithm (CrossBow, VLDB 2019; after
    EA-SGD, NIPS 2015): every step, the models are averaged over all workers, then each worker
    applies its own gradients to the average.  It decouples the batch size from the number of
    workers.  Arguments as ``SynchronousSGDOptimizer``."""
    _cluster.ensure()
    return _create(optimizer, _SynchronousAveraging(), name, use_locking)


def PairAveragingOptimizer(optimizer, fuse_requests=True, name=None, use_locking=False, with_keras=False,
                           fused_model_name=None):
    """PairAveragingOptimizer implements the AD-PSGD algorithm (ICML 2018).  Every step:

    1. pick a random peer;  2. pull its latest model from its model store (served by a background
    thread: the peer does not stop training);  3. average it with the local model;  4. apply the
    local gradients;  5. save the new model to the local store for peers to pull.

    The first step of each cluster epoch saves the model and waits for every peer (so every store
    holds a model before anyone pulls).  ``fuse_requests``: pull the whole model in one request
    (default) rather than one per variable.  ``fused_model_name``: the name the model is stored
    under (default: the wrapped optimizer's name; must be the same on every worker).  Other
    arguments as ``SynchronousSGDOptimizer``."""
    _cluster.ensure()
    return _create(optimizer, _PairAveraging(fuse_requests, fused_model_name or _optimizer_name(optimizer)),
                   name, use_locking)


def MonitorGradientNoiseScaleOptimizer(optimizer, device_batch_size, monitor_interval=1, name=None,
                                       use_locking=False, with_keras=False, **kwargs):
    """S-SGD that monitors the gradient noise scale ("An Empirical Model of Large-Batch
    Training", 2018) every ``monitor_interval`` steps, from this worker's gradient (over
    ``device_batch_size`` examples) and the averaged one (over ``device_batch_size * size``).
    Keyword arguments ``alpha`` (moving-average factor, default 0.9) and ``verbose`` (default
    True: rank 0 prints ``Gradient Noise Scale: ...``).  The latest estimate is
    ``opt.kungfu_algorithm.noise_scale`` (NaN with one worker)."""
    _cluster.ensure()
    algo = _GradientNoiseScale(device_batch_size, monitor_interval, alpha=kwargs.pop("alpha", 0.9),
                               verbose=kwargs.pop("verbose", True))
    if kwargs:
        raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
    return _create(optimizer, algo, name, use_locking)
