"""Variable broadcasting.  Mirrors ``horovod.tensorflow.functions`` /
``smdistributed.dataparallel.tensorflow.broadcast_variables``."""
import itertools

import tensorflow as tf

from sdp.tensorflow import ops

_calls = itertools.count()


def _value(v):
    """A tensor holding variable ``v``'s value (tf.Variable, Keras 3 variable, or tensor)."""
    if hasattr(v, "value") and not isinstance(v, tf.Tensor):
        val = v.value
        return val() if callable(val) else val
    return tf.convert_to_tensor(v)


def broadcast_variables(variables, root_rank):
    """Assign ``root_rank``'s values to ``variables`` (list of tf/Keras variables) on every rank.

    All variables travel in one op.  Works eagerly and inside ``tf.function``; returns ``None``
    eagerly and the grouped assign op in graphs.  Raises ``TypeError`` for objects that cannot
    be assigned (e.g. symbolic Keras tensors)."""
    variables = list(variables)
    if not variables:
        return None
    for v in variables:
        if not hasattr(v, "assign"):
            raise TypeError(f"broadcast_variables: {v!r} is not a variable (it has no assign())")
    call = next(_calls)
    names = [f"broadcast_variables.{call}.{i}" for i in range(len(variables))]
    new = ops.grouped_broadcast_tensors([_value(v) for v in variables], names, root_rank)
    assigns = [v.assign(n) for v, n in zip(variables, new)]
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None])
