"""Local gradient accumulation: communicate only every ``backward_passes_per_step`` passes.

Mirrors the behaviour of Horovod's ``LocalGradientAggregationHelper``: each pass adds its gradients
to local accumulators; on every ``backward_passes_per_step``-th pass the accumulated sums are
reduced over ranks (and divided by ``backward_passes_per_step`` if
``average_aggregated_gradients``), the accumulators are cleared and the optimizer applies them; on
the other passes the optimizer only advances its iteration counter.  Works eagerly, in
``tf.function`` and in ``tf.compat.v1`` graphs (two phases: ``compute`` then ``apply``).
"""
import tensorflow as tf


class LocalAggregator:
    """Accumulates gradients for ``steps`` passes before they are reduced and applied."""

    def __init__(self, steps, reducer, average_aggregated_gradients=False, sparse_as_dense=False):
        steps = int(steps)
        if steps <= 0:
            raise ValueError(f"backward_passes_per_step must be > 0, got {steps}")
        self.steps = steps
        self.reducer = reducer
        self.average = bool(average_aggregated_gradients)
        self.sparse_as_dense = bool(sparse_as_dense)
        self._acc = {}
        self._counter = None

    @property
    def counter(self):
        """The passes accumulated since the last communication (an int64 variable; None before
        the first pass).  Horovod's ``LocalGradientAggregationHelper.counter``."""
        return self._counter

    def _variable(self, shape, dtype, name):
        with tf.init_scope():
            return tf.Variable(tf.zeros(shape, dtype), trainable=False, name=name)

    def _ensure(self, grads):
        if self._counter is None:
            self._counter = self._variable([], tf.int64, "sdp_aggregation_counter")
        for i, g in enumerate(grads):
            if g is not None and i not in self._acc:
                self._acc[i] = self._variable(g.shape, g.dtype, f"sdp_aggregated_grad_{i}")

    def compute(self, grads, variables=None):
        """Accumulate ``grads``; return the reduced accumulated gradients on a communication pass,
        the local running sums otherwise (same structure; ``None`` stays ``None``).

        Raises ``ValueError`` for ``IndexedSlices`` unless ``sparse_as_dense=True``."""
        dense = []
        for g in grads:
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    raise ValueError("IndexedSlices are not supported when `backward_passes_per_step` > 1 "
                                     "and `sparse_as_dense` is False.")
                g = tf.convert_to_tensor(g)
            dense.append(g)
        self._ensure(dense)
        updates = [self._acc[i].assign_add(g) for i, g in enumerate(dense) if g is not None]
        with tf.control_dependencies(updates):
            count = self._counter.assign_add(1)
        with tf.control_dependencies([count]):
            summed = [None if g is None else self._acc[i].read_value() for i, g in enumerate(dense)]

        def communicate():
            reduced = self.reducer.reduce(summed, variables)
            if self.average:
                reduced = [None if r is None else r / tf.cast(self.steps, r.dtype) for r in reduced]
            deps = [r for r in reduced if r is not None]
            with tf.control_dependencies(deps):
                resets = [a.assign(tf.zeros_like(a)) for a in self._acc.values()]
                resets.append(self._counter.assign(0))
            with tf.control_dependencies(resets):
                return [tf.identity(r) for r in reduced if r is not None]

        def keep():
            return [tf.identity(s) for s in summed if s is not None]

        present = tf.cond(tf.equal(count, self.steps), communicate, keep)
        if not isinstance(present, (list, tuple)):
            present = [present]
        it = iter(present)
        return [None if g is None else next(it) for g in dense]

    def apply(self, apply_fn, skip_fn, deps=()):
        """Run ``apply_fn()`` on a communication pass (after ``compute`` has reset the
        counter), ``skip_fn()`` otherwise.  ``deps``: tensors returned by ``compute``, so that
        graphs read the counter after it was updated.  Eagerly it returns what the branch returned;
        in a graph, a bool tensor that depends on the branch's effects."""
        deps = [d for d in deps if d is not None]
        with tf.control_dependencies(deps):
            is_comm = tf.equal(self._counter.read_value(), 0)

        if tf.executing_eagerly():
            return apply_fn() if bool(is_comm) else skip_fn()
        return tf.cond(is_comm, _graph_branch(apply_fn), _graph_branch(skip_fn))


def _graph_branch(fn):
    """A ``tf.cond`` branch running ``fn`` for its side effects; returns a bool tensor that depends
    on everything ``fn`` returned (ops, tensors, or lazily read variables such as the result of
    ``variable.assign_add`` in graph mode, whose ``.op`` is the update)."""
    def branch():
        r = fn()
        deps = []
        for x in ([] if r is None else tf.nest.flatten(r)):
            if isinstance(x, (tf.Operation, tf.Tensor)):
                deps.append(x)
            elif getattr(x, "op", None) is not None:
                deps.append(x.op)
        with tf.control_dependencies(deps):
            return tf.constant(True)
    return branch
