"""Small TensorFlow helpers with the names of ``horovod.tensorflow.util``.

Horovod users' code and tests import these (``from horovod.tensorflow.util import
_executing_eagerly``); under ``sdprun --compat horovod`` that module is this one.

- ``_executing_eagerly() -> bool``: whether TensorFlow runs eagerly here (``False`` inside a
  ``tf.function`` trace or a ``tf.compat.v1`` graph).
- ``_make_subgraph(f)``: ``tf.function(f)``.
- ``_cache(f)``: memoizes ``f(*args)`` per ``(args, _executing_eagerly())``; ``args`` must be
  hashable (``TypeError`` otherwise, as in Horovod).
- ``vars_to_refs(vars)`` / ``refs_to_vars(refs)``: a (nested) list of variables to a hashable
  (nested) tuple of their ``.ref()`` and back (lists become tuples and tuples lists).
"""
import tensorflow as tf

__all__ = ["_executing_eagerly", "_make_subgraph", "_cache", "vars_to_refs", "refs_to_vars"]


def _executing_eagerly() -> bool:
    """True if TensorFlow executes eagerly in the current context.  Mirrors
    ``horovod.tensorflow.util._executing_eagerly``."""
    return tf.executing_eagerly()


def _make_subgraph(f):
    """``tf.function(f)``.  Mirrors ``horovod.tensorflow.util._make_subgraph``."""
    return tf.function(f)


def _cache(f):
    """Memoize ``f`` on its positional arguments and on whether TensorFlow runs eagerly, so a
    graph-building ``f`` is built once per mode.  Mirrors ``horovod.tensorflow.util._cache``."""
    cache = {}

    def wrapper(*args):
        key = (args, _executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]

    wrapper.__wrapped__ = f
    wrapper.__name__ = getattr(f, "__name__", "wrapper")
    wrapper.__doc__ = getattr(f, "__doc__", None)
    return wrapper


def vars_to_refs(vars):  # noqa: A002 (Horovod's parameter name)
    """A variable -> ``var.ref()``; a list (nested) of variables -> a tuple (nested) of refs,
    usable as a dict key.  Mirrors ``horovod.tensorflow.util.vars_to_refs``."""
    if isinstance(vars, list):
        return tuple(vars_to_refs(v) for v in vars)
    return vars.ref()


def refs_to_vars(refs):
    """Inverse of ``vars_to_refs``: a ref -> ``ref.deref()``; a tuple (nested) of refs -> a
    list (nested) of variables.  Mirrors ``horovod.tensorflow.util.refs_to_vars``."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
