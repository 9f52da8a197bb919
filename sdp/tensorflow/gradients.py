"""Reducing a list of gradients over all ranks: the one piece shared by ``DistributedGradientTape``
and every ``DistributedOptimizer``.

Dense gradients are compressed, allreduced (fused by the engine) and decompressed; ``IndexedSlices``
(e.g. embedding gradients) are allgathered (values and indices), or made dense first with
``sparse_as_dense=True``; ``None`` stays ``None``; gradients of variables registered as local are
not communicated.  The gradients of one call are handed to the engine bucket by bucket as the
backward pass produces them, and one op waits for all of them (see ``sdp.tensorflow.ops.Batch``).
"""
import warnings

import tensorflow as tf

from sdp import api
from sdp.common.reduce_ops import ReduceOp, resolve_op
from sdp.process_sets import global_process_set, set_size  # noqa: F401  (Horovod's hvd.global_process_set)
from sdp.tensorflow import ops
from sdp.tensorflow.compression import Compression


#: Horovod's error for sparse gradients with Adasum
ADASUM_SPARSE = ("The Adasum reduction does not currently support sparse tensors. As a workaround please pass "
                 "sparse_as_dense=True to DistributedOptimizer")


def check_process_set(process_set) -> int:
    """The engine id of ``process_set`` (a ``sdp.process_sets.ProcessSet``, an id, or None
    for the global set).  Raises ``ValueError`` for a set that is not registered (or was removed);
    ``sdp.tensorflow.errors.InvalidCollectiveError`` (``tf.errors.InvalidArgumentError``, a
    ``ValueError``, as Horovod) for a set that does not hold this rank, naming the set and the rank."""
    ps = api.process_set_id(process_set)
    if ps:
        ranks = api.process_set_ranks(ps)
        me = api.rank()
        if ranks is None:
            raise ValueError(f"{process_set}: process set {ps} is not registered (hvd.init(process_sets=...) or "
                             "hvd.add_process_set())")
        if me not in ranks:
            from sdp.tensorflow.errors import InvalidCollectiveError
            raise InvalidCollectiveError(f"rank {me} is not in process set {ps} (ranks {ranks}); only the set's ranks may "
                             "call its collectives")
    return ps


def check_devices(device_dense, device_sparse) -> None:
    """SMDDP documents ``device_dense``/``device_sparse`` as "Not supported. Raises not supported
    error.": raise ``NotImplementedError`` if either is given (non-empty)."""
    for label, value in (("device_dense", device_dense), ("device_sparse", device_sparse)):
        if value:
            raise NotImplementedError(f"{label}={value!r} is not supported: sdp places reductions itself")


def resolve_groups(num_groups=0, groups=None):
    """Horovod's ``num_groups`` (deprecated) / ``groups`` check.  Returns ``groups``.

    Raises ``ValueError`` unless ``groups`` is None, a positive int or a list of lists of
    variables.  Grouping changes no result in sdp: the engine fuses all gradients of a step into
    buckets of ``SDP_FUSION_THRESHOLD`` bytes by itself."""
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups`.", DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")
    return groups


def _ref(v):
    return v.ref() if hasattr(v, "ref") else id(v)


class GradientReducer:
    """Reduces gradients across ranks with fixed settings.

    ``name``: prefix of the collective names (made unique per graph, see ``ops.unique_name``).
    ``compression``: ``Compression.none``/``Compression.fp16``.  ``op``: ``ReduceOp`` (AVERAGE, SUM,
    MIN, MAX, PRODUCT, ADASUM: ``sdp.engine.adasum``, float gradients of the global set only;
    ``IndexedSlices`` raise Horovod's ``NotImplementedError`` unless ``sparse_as_dense``).
    ``gradient_predivide_factor`` (AVERAGE only, else ``ValueError``) scales by ``1/f`` before the
    sum and ``f/size`` after.
    ``scale_local_gradients``: divide gradients of local variables by ``size()``, as Horovod does.
    ``process_set``: the set whose ranks reduce together (an id or a ``ProcessSet``; checked on
    every call, see ``check_process_set``); AVERAGE divides by its size.  On a rank outside the
    set, ``reduce`` returns the gradients as they are (Horovod's tape and optimizers do so).
    """

    def __init__(self, name, compression=Compression.none, sparse_as_dense=False, op=ReduceOp.AVERAGE,
                 gradient_predivide_factor=1.0, scale_local_gradients=True, process_set=global_process_set):
        self.name = name
        self.process_set = process_set
        self.compression = compression if compression is not None else Compression.none
        self.sparse_as_dense = bool(sparse_as_dense)
        self.op = resolve_op(op)
        self.prescale, self.postscale = 1.0, 1.0
        if gradient_predivide_factor != 1.0:
            if self.op != ReduceOp.AVERAGE:
                raise ValueError("gradient_predivide_factor not supported with op != Average")
            self.prescale = 1.0 / gradient_predivide_factor
            self.postscale = float(gradient_predivide_factor)
        self.scale_local_gradients = scale_local_gradients
        self._local = set()

    def register_local(self, var) -> None:
        """Gradients of ``var`` stay local to each rank (Horovod's ``register_local_var``)."""
        self._local.add(_ref(var))

    @property
    def has_local(self) -> bool:
        return bool(self._local)

    def is_local(self, var) -> bool:
        """Whether ``var`` was registered with ``register_local``."""
        return _ref(var) in self._local

    def reduce(self, grads, variables=None):
        """Return ``grads`` (list of ``tf.Tensor``/``tf.IndexedSlices``/``None``) reduced over all
        ranks, in the same order, shapes and dtypes.  ``variables`` (same length) is needed only
        when local variables are registered."""
        grads = list(grads)
        if self._local and (variables is None or len(variables) != len(grads)):
            raise ValueError("local variables are registered: pass the variables matching the gradients")
        local = [bool(self._local) and _ref(v) in self._local for v in (variables or [None] * len(grads))]
        ps_id = api.process_set_id(self.process_set)
        if ps_id and api.rank() not in (api.process_set_ranks(ps_id) or [api.rank()]):
            return grads  # a rank outside the set keeps its own gradients, as with Horovod
        ps = check_process_set(self.process_set)
        if self.op == ReduceOp.ADASUM:
            api.check_adasum(ps)
        prefix = ops.unique_name(self.name)
        batch = ops.Batch("gradient allreduce", ps)
        plan = []
        for i, (g, is_local) in enumerate(zip(grads, local)):
            if g is None or is_local:
                plan.append(None)
                continue
            if isinstance(g, tf.IndexedSlices) and self.sparse_as_dense:
                g = tf.convert_to_tensor(g)
            if isinstance(g, tf.IndexedSlices):
                if self.op == ReduceOp.ADASUM:
                    raise NotImplementedError(ADASUM_SPARSE)
                if self.op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
                    raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
                if self.prescale != 1.0 or self.postscale != 1.0:
                    raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
                vi = batch.add_allgather(g.values, f"{prefix}.grad_{i}.values")
                ii = batch.add_allgather(g.indices, f"{prefix}.grad_{i}.indices")
                plan.append(("sparse", g, vi, ii))
            else:
                c, ctx = self.compression.compress(g)
                ri = batch.add_allreduce(c, f"{prefix}.grad_{i}", self.op, self.prescale, self.postscale)
                plan.append(("dense", ctx, ri))
        results = batch.run()
        out = []
        n = set_size(ps)
        for g, p, is_local in zip(grads, plan, local):
            if p is None:
                if is_local and g is not None and self.scale_local_gradients and n > 1:
                    g = (tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
                         if isinstance(g, tf.IndexedSlices) else g / n)
                out.append(g)
            elif p[0] == "dense":
                out.append(self.compression.decompress(results[p[2]], p[1]))
            else:
                _, sg, vi, ii = p
                values = results[vi]
                if self.op == ReduceOp.AVERAGE:
                    values = values / tf.cast(n, values.dtype)
                out.append(tf.IndexedSlices(values, results[ii], dense_shape=sg.dense_shape))
        return out
