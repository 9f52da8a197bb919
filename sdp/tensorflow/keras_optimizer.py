"""``DistributedOptimizer`` for Keras optimizers: Keras 3 (``keras.optimizers.*``) and ``tf_keras``
(Keras 2; new ``tf_keras.optimizers.*`` and ``tf_keras.optimizers.legacy.*``).

The wrapper is an instance of a subclass of the user's optimizer class, created on the fly with
the same class name and module (so ``isinstance(opt, keras.optimizers.Adam)`` holds and a saved
model records a plain ``Adam``).  It overrides one method through which every update passes:

* Keras 3: ``apply(grads, trainable_variables)`` (``apply_gradients`` and ``model.fit`` reach it);
* tf_keras: ``apply_gradients(grads_and_vars, ...)`` (``minimize`` and ``model.fit`` reach it).

There the gradients are reduced over all ranks (see ``sdp.tensorflow.gradients.GradientReducer``)
before the base class applies them.  On tf_keras, Horovod's hooks are there too:
``_compute_gradients(loss, var_list, grad_loss=None, tape=None)`` returns the reduced (or, with
``backward_passes_per_step``, accumulated) gradients, which ``apply_gradients`` then applies as
they are, and ``_agg_helper`` is the accumulator (``counter``: passes since the last
communication) or None.  ``opt.variables`` stays a list that can also be called
(``opt.variables()``), as Horovod scripts written for Keras 2 do.
"""
import warnings

import tensorflow as tf

from sdp.tensorflow.aggregation import LocalAggregator
from sdp.tensorflow.gradients import GradientReducer


class VariableList(list):
    """A list of variables that can also be called: ``opt.variables`` and ``opt.variables()``
    both work (Keras 3 made ``variables`` a property; Keras 2 scripts call it)."""

    def __call__(self):
        return self


class _Settings:
    """The wrapper's configuration (kept outside Keras' attribute tracking)."""

    def __init__(self, reducer, aggregator):
        self.reducer = reducer
        self.aggregator = aggregator


def _module_of(cls) -> str:
    return getattr(cls, "__module__", "") or ""


def flavor(optimizer):
    """``"keras3"``, ``"tf_keras"`` or ``None`` for an optimizer object."""
    return flavor_of_class(type(optimizer))


def flavor_of_class(cls):
    """``"keras3"``, ``"tf_keras"`` or ``None`` for an optimizer class (decided by the modules of
    its bases: ``keras.src.optimizers`` is Keras 3, ``tf_keras.`` is Keras 2)."""
    for c in cls.__mro__:
        mod = _module_of(c)
        if mod.startswith("keras.src.optimizers") or mod.startswith("keras.optimizers"):
            return "keras3"
        if mod.startswith("tf_keras."):
            return "tf_keras"
    return None


class _Keras3Mixin:
    """Methods of a distributed Keras 3 optimizer (placed before the user's class in the MRO)."""

    def apply(self, grads, trainable_variables=None):
        st = self.__dict__["_sdp_settings"]
        grads = list(grads)
        if not grads:
            return super().apply(grads, trainable_variables)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            variables = trainable_variables
        else:
            variables = list(getattr(self, "_trainable_variables", []) or [])
        if st.aggregator is None:
            return super().apply(st.reducer.reduce(grads, variables or None), trainable_variables)
        if not self.built:
            self.build(variables)
        out = st.aggregator.compute(grads, variables or None)
        base_apply = super().apply
        return st.aggregator.apply(lambda: base_apply(out, trainable_variables),
                                   lambda: self._iterations.assign_add(1), deps=out)

    @property
    def variables(self):
        return VariableList(super().variables)

    def register_local_var(self, var):
        """Keep the gradient of ``var`` local to each rank (not reduced; divided by ``size()`` if
        ``scale_local_gradients``).  Mirrors Horovod's ``register_local_var``."""
        self.__dict__["_sdp_settings"].reducer.register_local(var)


class _TfKerasMixin:
    """Methods of a distributed tf_keras optimizer (new or legacy)."""

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        st = self.__dict__["_sdp_settings"]
        pairs = list(grads_and_vars)
        if not pairs:
            return super().apply_gradients(pairs, *args, **kwargs)
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        done = self.__dict__.pop("_sdp_reduced", None)
        if done is not None and len(done) == len(grads) and all(g is d for g, d in zip(grads, done)):
            if st.aggregator is None:  # (from _compute_gradients: reduced already)
                return super().apply_gradients(pairs, *args, **kwargs)
            base = super().apply_gradients
            return st.aggregator.apply(lambda: base(pairs, *args, **kwargs),
                                       lambda: self.iterations.assign_add(1), deps=grads)
        if st.aggregator is None:
            reduced = st.reducer.reduce(grads, variables)
            return super().apply_gradients(list(zip(reduced, variables)), *args, **kwargs)
        self._sdp_build(variables)
        out = st.aggregator.compute(grads, variables)
        base = super().apply_gradients
        return st.aggregator.apply(lambda: base(list(zip(out, variables)), *args, **kwargs),
                                   lambda: self.iterations.assign_add(1), deps=out)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """``(gradient, variable)`` pairs of ``loss`` (a tensor computed under ``tape``, or a
        callable) for ``var_list``, the gradients reduced over the ranks (accumulated locally on
        the passes between communications with ``backward_passes_per_step``); ``apply_gradients``
        of these pairs applies them as they are.  Mirrors Horovod's ``_compute_gradients`` of its
        Keras ``DistributedOptimizer``."""
        st = self.__dict__["_sdp_settings"]
        base = super()
        tape = tf.GradientTape() if tape is None else tape
        if hasattr(base, "_compute_gradients"):  # legacy OptimizerV2
            pairs = base._compute_gradients(loss, var_list, grad_loss, tape=tape)
        else:
            pairs = base.compute_gradients(loss, var_list, tape=tape)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if st.aggregator is None:
            reduced = st.reducer.reduce(grads, variables)
        else:
            self._sdp_build(variables)
            reduced = st.aggregator.compute(grads, variables)
        self.__dict__["_sdp_reduced"] = list(reduced)
        return list(zip(reduced, variables))

    @property
    def _agg_helper(self):
        """The gradient accumulator with ``backward_passes_per_step`` > 1 (its ``counter``: the
        passes since the last communication), else None.  Horovod's attribute of that name."""
        return self.__dict__["_sdp_settings"].aggregator

    def _sdp_build(self, variables):
        """Create the optimizer's variables now (both builders are idempotent), so that they are
        not first created inside the ``tf.cond`` of gradient accumulation."""
        with tf.init_scope():
            if hasattr(self, "_create_all_weights"):  # legacy OptimizerV2
                self._create_all_weights(variables)
            else:
                self.build(variables)

    def register_local_var(self, var):
        """Keep the gradient of ``var`` local to each rank.  Mirrors Horovod's ``register_local_var``."""
        self.__dict__["_sdp_settings"].reducer.register_local(var)


class _TfKerasVariablesProperty:
    @property
    def variables(self):
        return VariableList(super().variables)


_classes = {}


def distributed_class(base):
    """The distributed subclass of optimizer class ``base`` (cached; same name and module)."""
    cls = _classes.get(base)
    if cls is not None:
        return cls
    if getattr(base, "_sdp_distributed", False):
        return base
    kind = flavor_of_class(base)
    if kind == "keras3":
        mixins = (_Keras3Mixin,)
    elif kind == "tf_keras":
        mixins = (_TfKerasMixin,)
        if isinstance(_find_attr(base, "variables"), property):
            mixins += (_TfKerasVariablesProperty,)
    else:
        raise ValueError(f"{base.__name__} is not a Keras optimizer class")
    cls = type(base.__name__, mixins + (base,), {
        "__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__,
        "_sdp_distributed": True})
    _classes[base] = cls
    return cls


def _find_attr(cls, name):
    for c in cls.__mro__:
        if name in c.__dict__:
            return c.__dict__[name]
    return None


def install(optimizer, reducer, aggregator=None):
    """Turn ``optimizer`` itself into a distributed one (class swap: its state, identity and
    tracking are kept).  Used by ``load_model``.  Returns ``optimizer``."""
    base = type(optimizer)
    if getattr(base, "_sdp_distributed", False):
        base = next(c for c in base.__mro__[1:] if not getattr(c, "_sdp_distributed", False)
                    and c not in (_Keras3Mixin, _TfKerasMixin, _TfKerasVariablesProperty))
    optimizer.__class__ = distributed_class(base)
    optimizer.__dict__["_sdp_settings"] = _Settings(reducer, aggregator)
    return optimizer


def wrap(optimizer, reducer, aggregator=None):
    """A new distributed optimizer with ``optimizer``'s configuration and state.

    Like Horovod, the new object is built from ``optimizer.get_config()`` (the original is left
    unchanged); if ``optimizer`` already has variables (it was built or restored), the new one is
    built on the same model variables and receives their values.  Raises ``ValueError`` if the
    class cannot be rebuilt from its config."""
    base = type(optimizer)
    if getattr(base, "_sdp_distributed", False):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the original optimizer")
    cls = distributed_class(base)
    try:
        new = cls.from_config(optimizer.get_config())
    except Exception as e:  # noqa: BLE001 - any failure means the config does not round-trip
        raise ValueError(f"DistributedOptimizer rebuilds {base.__name__} from its get_config(), which "
                         f"failed: {e!r}. Make get_config()/from_config() round-trip.") from e
    new.__dict__["_sdp_settings"] = _Settings(reducer, aggregator)
    _copy_state(optimizer, new)
    return new


def _copy_state(old, new):
    """Carry a built optimizer's variables over to its rebuilt distributed copy."""
    if flavor(old) == "keras3":
        if not getattr(old, "built", False):
            return
        new.build(list(old._trainable_variables))
        src, dst = list(old.variables), list(new.variables)
        if len(src) != len(dst):
            raise ValueError(f"cannot carry the state of {type(old).__name__} over: {len(src)} variables, "
                             f"the rebuilt optimizer has {len(dst)}")
        for s, d in zip(src, dst):
            d.assign(s)
        return
    # tf_keras does not keep the list of model variables it was built on: carry the step count;
    # slot variables (momentum, Adam moments) start from zero, as with Horovod's from_config().
    src = list(old.variables() if callable(old.variables) else old.variables)
    if len(src) > 1:
        warnings.warn(f"DistributedOptimizer: {type(old).__name__} already has slot variables; the wrapped "
                      "optimizer starts with fresh ones. Wrap the optimizer before the first training step.",
                      stacklevel=4)
    it = getattr(old, "iterations", None)
    if it is not None and hasattr(new, "iterations"):
        new.iterations.assign(tf.cast(it, new.iterations.dtype))


def make(optimizer, name=None, compression=None, sparse_as_dense=False, op=None, gradient_predivide_factor=1.0,
         backward_passes_per_step=1, average_aggregated_gradients=False, scale_local_gradients=True,
         process_set=None):
    """Build the reducer/aggregator for ``optimizer`` (reducing among ``process_set``'s ranks;
    None: all) and return the distributed optimizer."""
    from sdp.common.reduce_ops import ReduceOp
    reducer = GradientReducer(name or f"DistributedOptimizer.{type(optimizer).__name__}", compression,
                              sparse_as_dense, ReduceOp.AVERAGE if op is None else op,
                              gradient_predivide_factor, scale_local_gradients, process_set)
    aggregator = None
    if backward_passes_per_step > 1:
        aggregator = LocalAggregator(backward_passes_per_step, reducer, average_aggregated_gradients,
                                     sparse_as_dense)
    return wrap(optimizer, reducer, aggregator)
