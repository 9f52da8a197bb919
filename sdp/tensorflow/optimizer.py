"""``DistributedOptimizer`` for every optimizer family: ``tf.compat.v1.train.Optimizer`` (TF1
graphs), Keras 3 and tf_keras optimizers (see ``sdp.tensorflow.keras_optimizer``).

Mirrors ``smdistributed.dataparallel.tensorflow.DistributedOptimizer`` and
``horovod.tensorflow.DistributedOptimizer``.
"""
import tensorflow as tf

from sdp import api
from sdp.common.config import bucket_cap_mb_to_bytes
from sdp.common.reduce_ops import ReduceOp, resolve_op
from sdp.tensorflow import keras_optimizer
from sdp.tensorflow.aggregation import LocalAggregator, _graph_branch
from sdp.tensorflow.compression import Compression, gradient_compression
from sdp.tensorflow.gradients import (GradientReducer, check_devices, check_process_set, global_process_set,
                                      resolve_groups)

_LegacyOptimizer = tf.compat.v1.train.Optimizer


class WrappedLegacyOptimizer(_LegacyOptimizer):
    """Base of optimizers that wrap a ``tf.compat.v1.train.Optimizer`` (ours and the KungFu
    bridge's): gradients, slots and variables are the wrapped optimizer's."""

    def __init__(self, optimizer, name, use_locking=False):
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer

    def compute_gradients(self, *args, **kwargs):
        return self._optimizer.compute_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


class _DistributedLegacyOptimizer(WrappedLegacyOptimizer):
    """Wraps a ``tf.compat.v1.train.Optimizer``: ``compute_gradients`` returns gradients reduced
    over all ranks; everything else is delegated to the wrapped optimizer."""

    def __init__(self, optimizer, name, use_locking, reducer, aggregator):
        super().__init__(optimizer, name, use_locking)
        self._sdp_reducer = reducer
        self._sdp_aggregator = aggregator

    def register_local_var(self, var):
        """Keep the gradient of ``var`` local to each rank.  Mirrors Horovod's ``register_local_var``."""
        self._sdp_reducer.register_local(var)

    def compute_gradients(self, *args, **kwargs):
        """``Optimizer.compute_gradients`` of the wrapped optimizer, then reduced over all ranks
        (on every ``backward_passes_per_step``-th call when accumulating).  Returns a list of
        ``(gradient, variable)``."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads, variables = zip(*pairs)
        if self._sdp_aggregator is not None:
            reduced = self._sdp_aggregator.compute(list(grads), list(variables))
        else:
            reduced = self._sdp_reducer.reduce(list(grads), list(variables))
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Delegates to the wrapped optimizer (skipped, except for ``global_step``, on passes that
        only accumulate)."""
        if self._sdp_aggregator is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        pairs = list(grads_and_vars)

        def skip():
            return global_step.assign_add(1) if global_step is not None else tf.no_op()

        return self._sdp_aggregator.apply(
            lambda: self._optimizer.apply_gradients(pairs, global_step=global_step, name=name), skip,
            deps=[g for g, _ in pairs])


class _DistributedAdasumOptimizer(WrappedLegacyOptimizer):
    """Horovod's ``DistributedOptimizer(op=Adasum)`` of a ``tf.compat.v1.train.Optimizer`` (its
    ``_DistributedAdasumOptimizer``, the delta optimizer of Horovod's Adasum guide): the wrapped
    optimizer applies this rank's own gradients (``compute_gradients`` is not reduced); on every
    ``backward_passes_per_step``-th ``apply_gradients`` each variable's change since the last
    communication (its delta; the first call takes the variables' values then as the start) is
    combined over all ranks with Adasum (``reducer``: a ``GradientReducer`` of ``op=Adasum``,
    compression included), the start moves by the combined delta and every variable becomes the
    start.  No averaging: Horovod's guide sets the learning rate at 2-2.5x a single worker's, or,
    hierarchical (``SDP_HIERARCHICAL=1`` across hosts), a single worker's times the ranks per host.
    Eagerly, in ``tf.function`` and in ``tf.compat.v1`` graphs."""

    def __init__(self, optimizer, name, use_locking, reducer, steps: int):
        super().__init__(optimizer, name, use_locking)
        self._sdp_reducer = reducer
        self._sdp_steps = int(steps)
        self._sdp_starts = {}  # variable ref -> its start (non-trainable, made at the first call)
        self._sdp_count = None  # apply_gradients calls so far

    def _variable(self, like, name):
        with tf.init_scope():
            return tf.Variable(tf.zeros(like.shape, like.dtype), trainable=False, name=name)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's ``apply_gradients`` with this rank's gradients, then, on a
        communication step, the variables set to start + Adasum of the ranks' deltas.  Returns
        an op (graphs) that runs all of it."""
        pairs = list(grads_and_vars)
        variables = [v for g, v in pairs if g is not None]
        if self._sdp_count is None:
            self._sdp_count = self._variable(tf.constant(0, tf.int64), "sdp_adasum_step")
        for v in variables:
            if v.ref() not in self._sdp_starts:
                self._sdp_starts[v.ref()] = self._variable(v, "sdp_adasum_start")
        starts = [self._sdp_starts[v.ref()] for v in variables]
        count = self._sdp_count.read_value()

        def begin():  # (the variables as every rank holds them before the first step)
            return tf.group([s.assign(v) for s, v in zip(starts, variables)])

        def communicate():
            deltas = [v - s for v, s in zip(variables, starts)]
            combined = self._sdp_reducer.reduce(deltas)
            news = [s.assign_add(d) for s, d in zip(starts, combined)]
            return tf.group([v.assign(n) for v, n in zip(variables, news)])

        eager = tf.executing_eagerly()
        first = tf.equal(count, 0)
        init = (begin() if bool(first) else None) if eager else tf.cond(first, _graph_branch(begin),
                                                                           _graph_branch(tf.no_op))
        with tf.control_dependencies([] if init is None else [init]):
            applied = self._optimizer.apply_gradients(pairs, global_step=global_step, name=name)
        comm = tf.equal(count % self._sdp_steps, self._sdp_steps - 1)
        with tf.control_dependencies([applied] if not eager else []):
            done = ((communicate() if bool(comm) else None) if eager
                    else tf.cond(comm, _graph_branch(communicate), _graph_branch(tf.no_op)))
        with tf.control_dependencies([] if done is None else [done]):
            return self._sdp_count.assign_add(1, read_value=False)  # (eagerly None; in a graph the op)


def apply_bucket_cap(bucket_cap_mb) -> None:
    """Set the engine's fusion buffer to ``bucket_cap_mb`` MiB (SMDDP's argument; rank 0's value
    decides the buckets of every rank).  ``None`` leaves it alone.  Raises ``ValueError`` unless
    ``bucket_cap_mb * 1024 * 1024`` is a non-negative multiple of 128 bytes."""
    if bucket_cap_mb is None:
        return
    api.set_fusion_threshold(bucket_cap_mb_to_bytes(bucket_cap_mb))


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False, op=ReduceOp.AVERAGE,
                         bucket_cap_mb=None, *, backward_passes_per_step=1, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wrap ``optimizer`` so that gradients are reduced (averaged by default) over all ranks before
    they are applied.

    ``optimizer``: a ``tf.compat.v1.train.Optimizer`` (returns a wrapper whose
    ``compute_gradients`` reduces; use it in TF1 graphs), a Keras 3 optimizer or a tf_keras
    optimizer (returns an instance of a subclass of the optimizer's own class; see
    ``sdp.tensorflow.keras.DistributedOptimizer``).  Anything else raises ``ValueError``.

    Positional arguments follow SMDDP: ``name`` (default ``"Distributed" + class name``),
    ``use_locking``, ``device_dense``/``device_sparse`` (not supported: a non-empty value raises
    ``NotImplementedError``), ``compression`` (``Compression.none``/``fp16``; the fp16 cast is
    skipped while no rank is across a network unless ``SDP_FP16_SKIP_LOCAL=0``, see
    ``sdp.tensorflow.compression.gradient_compression``),
    ``sparse_as_dense`` (densify ``IndexedSlices`` instead of allgathering them), ``op``
    (``ReduceOp``; default AVERAGE; ``Adasum``: Horovod's delta optimizer for a
    ``tf.compat.v1.train.Optimizer``, see ``_DistributedAdasumOptimizer``; for a Keras
    optimizer, ``ValueError`` as in Horovod), ``bucket_cap_mb``
    (fusion buffer size in MiB for the whole job; ``ValueError`` unless ``bucket_cap_mb * 2**20``
    is a multiple of 128; every rank must pass the same value).

    Horovod's other arguments are keyword-only (Horovod's positional order differs from SMDDP's
    after ``sparse_as_dense``): ``backward_passes_per_step`` (reduce and apply every N passes,
    accumulating locally in between; TF1 optimizers need graph mode for N > 1, as in Horovod),
    ``average_aggregated_gradients`` (divide the accumulated sum by N), ``gradient_predivide_factor``
    (AVERAGE only), ``num_groups``/``groups`` (validated; no effect on results),
    ``process_set`` (the ranks that reduce together; default all), ``scale_local_gradients``.

    Mirrors ``smdistributed.dataparallel.tensorflow.DistributedOptimizer`` and
    ``horovod.tensorflow.DistributedOptimizer``."""
    check_devices(device_dense, device_sparse)
    api.process_set_id(process_set)  # a registered set (membership is checked when reducing)
    resolve_groups(num_groups, groups)
    op = resolve_op(op)
    if op == ReduceOp.ADASUM and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    if gradient_predivide_factor != 1.0 and op != ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step must be > 0, got {backward_passes_per_step}")
    compression = gradient_compression(compression)
    if isinstance(optimizer, _LegacyOptimizer) and op == ReduceOp.ADASUM:
        if api.process_set_id(process_set):
            raise NotImplementedError("Adasum does not support process sets yet")
        apply_bucket_cap(bucket_cap_mb)
        name = name or f"DistributedDelta{type(optimizer).__name__}"
        return _DistributedAdasumOptimizer(optimizer, name, use_locking, GradientReducer(
            name, compression, sparse_as_dense, op), backward_passes_per_step)
    if isinstance(optimizer, _LegacyOptimizer):
        apply_bucket_cap(bucket_cap_mb)
        name = name or f"Distributed{type(optimizer).__name__}"
        reducer = GradientReducer(name, compression, sparse_as_dense, op, gradient_predivide_factor,
                                  scale_local_gradients, process_set)
        aggregator = None
        if backward_passes_per_step > 1:
            if tf.executing_eagerly():
                raise ValueError("backward_passes_per_step > 1 is not yet supported for _LegacyOptimizer "
                                 "with eager execution.")
            aggregator = LocalAggregator(backward_passes_per_step, reducer, average_aggregated_gradients,
                                         sparse_as_dense)
        return _DistributedLegacyOptimizer(optimizer, name, use_locking, reducer, aggregator)
    if keras_optimizer.flavor(optimizer) is not None:
        if op == ReduceOp.ADASUM:
            raise ValueError("op == Adasum is not supported yet with Keras")
        if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise ValueError("op currently only supports Average and Sum")
        apply_bucket_cap(bucket_cap_mb)
        return keras_optimizer.make(optimizer, name, compression, sparse_as_dense, op, gradient_predivide_factor,
                                    backward_passes_per_step, average_aggregated_gradients,
                                    scale_local_gradients, process_set)
    raise ValueError("Provided optimizer doesn't inherit from either legacy TensorFlow or Keras optimizer: "
                     f"{optimizer!r}")
