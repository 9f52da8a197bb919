"""Broadcasting variables and Python objects.  Mirrors ``horovod.tensorflow.functions``
(``broadcast_variables``, ``broadcast_object``, ``broadcast_object_fn``, ``allgather_object``),
``horovod.tensorflow.broadcast_global_variables`` / ``broadcast_`` and
``smdistributed.dataparallel.tensorflow.broadcast_variables`` /
``broadcast_global_variables``."""
import itertools

import tensorflow as tf

from sdp import api
from sdp.tensorflow import ops
from sdp.tensorflow.gradients import check_process_set, global_process_set

def _value(v):
    """A tensor holding variable ``v``'s value (tf.Variable, Keras 3 variable, or tensor)."""
    if isinstance(v, tf.Variable):
        return v.read_value() if not tf.executing_eagerly() else tf.convert_to_tensor(v)
    if hasattr(v, "value") and not isinstance(v, tf.Tensor):
        val = v.value
        return tf.convert_to_tensor(val() if callable(val) else val)
    return tf.convert_to_tensor(v)


def _check_variables(variables, what):
    variables = list(variables() if callable(variables) and not hasattr(variables, "__iter__") else variables)
    for v in variables:
        if not hasattr(v, "assign"):
            raise TypeError(f"{what}: {v!r} is not a variable (it has no assign())")
    return variables


def _broadcast_assign(variables, root_rank, base, process_set=0):
    prefix = ops.unique_name(base)  # eagerly: ``base`` itself (calls complete one after another)
    names = [f"{prefix}.{i}" for i in range(len(variables))]
    new = ops.grouped_broadcast_tensors([_value(v) for v in variables], names, root_rank, process_set)
    assigns = [v.assign(n) for v, n in zip(variables, new)]
    return new, assigns


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assign ``root_rank``'s values to ``variables`` (list of ``tf.Variable``/Keras variables) on
    every rank.

    All variables travel in one op.  Eagerly it returns ``None``; in a graph (``tf.function`` or
    ``tf.compat.v1``) it returns the grouped assign op, to be run (``session.run``).  Shapes and
    dtypes must agree on every rank (``TensorMismatchError`` otherwise); a ``root_rank`` outside
    ``[0, size)`` raises ``TensorMismatchError``; a non-variable raises ``TypeError``.
    ``inplace`` is accepted for Horovod compatibility (sdp always assigns in place).
    ``process_set``: only its ranks take part (``root_rank``, a job rank, must be one of them)."""
    ps = check_process_set(process_set)
    variables = _check_variables(variables, "broadcast_variables")
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    _, assigns = _broadcast_assign(variables, root_rank, "broadcast_variables", ps)
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None])


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast: assign ``root_rank``'s values to ``variables`` and return the new values
    (a list of tensors).  Mirrors ``horovod.tensorflow.broadcast_``."""
    ps = check_process_set(process_set)
    variables = _check_variables(variables, "broadcast_")
    if not variables:
        return []
    new, assigns = _broadcast_assign(variables, root_rank, name or "broadcast_", ps)
    if tf.executing_eagerly():
        return new
    with tf.control_dependencies([a for a in assigns if a is not None]):
        return [tf.identity(n) for n in new]


def broadcast_global_variables(root_rank):
    """Broadcast all ``tf.compat.v1.global_variables()`` from ``root_rank``; returns the op to
    run.  Graph mode only (TF1 style): eagerly it raises ``RuntimeError``, as Horovod does
    (use ``broadcast_variables`` with the model's and optimizer's variables instead).
    Mirrors ``horovod.tensorflow.broadcast_global_variables`` /
    ``smdistributed.dataparallel.tensorflow.broadcast_global_variables``."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. "
            "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Pickle ``obj`` on ``root_rank`` and return it on every rank (runs at once, in graph mode
    too; ``session`` is accepted for TF1 compatibility).  Mirrors
    ``horovod.tensorflow.broadcast_object``."""
    return api.broadcast_object(obj, root_rank, name, check_process_set(process_set))


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """Return ``fn(obj) -> obj`` that broadcasts ``obj`` from ``root_rank`` each time it is
    called.  Mirrors ``horovod.tensorflow.broadcast_object_fn``."""
    ps = check_process_set(process_set)
    base = name or "broadcast_object_fn"
    calls = itertools.count()

    def _bcast(obj):
        return api.broadcast_object(obj, root_rank, f"{base}.{next(calls)}", ps)

    return _bcast


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Pickle ``obj`` on every rank and return the list of all ranks' objects, in rank order.
    Mirrors ``horovod.tensorflow.allgather_object``."""
    return api.allgather_object(obj, name, check_process_set(process_set))
