"""Keras 3 optimizers under Horovod's spelling: ``opt.variables()``.

Horovod/SageMaker scripts call ``hvd.broadcast_variables(opt.variables(), root_rank=0)``; in Keras 3
``Optimizer.variables`` is a property returning a list.  ``patch_keras_optimizer_variables``
(called by ``import sdp.tensorflow``, and again by ``sdp.compat`` when a Horovod/SMDDP alias of a
TensorFlow face is imported, for optimizer classes defined since) makes that property return a list
subclass that is also callable (calling it returns the list itself), so both spellings work.
tf_keras already accepts both."""


class _CallableVariableList(list):
    """The variables of a Keras 3 optimizer: a list that can also be called (``opt.variables()``,
    the Keras 2 / Horovod spelling) and then returns itself."""

    def __call__(self):
        return self


def _patch_variables_property(cls) -> bool:
    prop = cls.__dict__.get("variables")
    if not isinstance(prop, property) or prop.fget is None:
        return False
    if getattr(prop.fget, "__sdp_compat__", False):
        return True
    original = prop.fget

    def variables(self, _original=original):
        value = _original(self)
        if isinstance(value, list) and not isinstance(value, _CallableVariableList):
            value = _CallableVariableList(value)
        return value

    variables.__sdp_compat__ = True
    variables.__doc__ = original.__doc__
    setattr(cls, "variables", property(variables, prop.fset, prop.fdel, prop.__doc__))
    return True


def patch_keras_optimizer_variables() -> bool:
    """Make ``optimizer.variables()`` work on Keras 3 optimizers (``variables`` stays a list).

    Patches the ``variables`` property of Keras' base optimizer class and of every optimizer
    class defined so far that overrides it (e.g. ``LossScaleOptimizer``); idempotent.  Does
    nothing (and returns ``False``) without Keras 3."""
    try:
        import keras
    except Exception:
        return False
    base = getattr(getattr(keras, "optimizers", None), "Optimizer", None)
    if base is None:
        return False
    root = next((c for c in base.__mro__ if "variables" in c.__dict__), None)
    if root is None or not _patch_variables_property(root):
        return False  # Keras 2 style: variables() is already a method
    todo, seen = [root], set()
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                _patch_variables_property(sub)
                todo.append(sub)
    return True
