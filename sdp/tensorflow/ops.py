"""TensorFlow ops over the engine: each collective is one ``tf.py_function`` that hands numpy
views of the inputs to :mod:`sdp.api`, so they work eagerly and inside ``tf.function``.

A list of tensors goes through one ``py_function`` call, so the engine sees them together and
fuses them into buckets.
"""
import itertools
import threading

import numpy as np
import tensorflow as tf

from sdp import api

_name_lock = threading.Lock()
_name_counts = {}


def _base_name(kind: str, tensor=None, name=None) -> str:
    """A name that matches across ranks: the given one; in graphs, from the op name (stable per
    trace); eagerly, from a per-process counter."""
    if name:
        return name
    if tensor is not None and not tf.executing_eagerly() and hasattr(tensor, "op"):
        return f"{kind}.{tensor.op.name}"
    with _name_lock:
        c = _name_counts.setdefault(kind, itertools.count())
        return f"{kind}.noname.{next(c)}"


def _as_tensor(t):
    return t if isinstance(t, (tf.Tensor, tf.Variable)) else tf.convert_to_tensor(t)


def _run_numpy(fn, tensors, out_dtypes, out_shapes, name):
    """Run ``fn(list of numpy arrays) -> list of numpy arrays`` as one py_function op."""
    def body(*ts):
        return fn([t.numpy() for t in ts])

    outs = tf.py_function(func=body, inp=list(tensors), Tout=list(out_dtypes), name=name.replace(":", "_")
                          .replace("/", "_")[:100] if name else None)
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    for o, s in zip(outs, out_shapes):
        o.set_shape(s)
    return list(outs)


def grouped_allreduce_tensors(tensors, names, op, prescale_factor=1.0, postscale_factor=1.0):
    """Allreduce a list of tensors in one op (fused by the engine); same shapes/dtypes out."""
    api.runtime("allreduce()")
    tensors = [_as_tensor(t) for t in tensors]
    if not tensors:
        return []

    def fn(arrays):
        return [h.wait() for h in api.grouped_allreduce_async(arrays, names, op, prescale_factor,
                                                              postscale_factor)]

    return _run_numpy(fn, tensors, [t.dtype for t in tensors], [t.shape for t in tensors], names[0])


def allreduce_tensor(tensor, name, op, prescale_factor=1.0, postscale_factor=1.0):
    return grouped_allreduce_tensors([tensor], [name], op, prescale_factor, postscale_factor)[0]


def grouped_broadcast_tensors(tensors, names, root_rank):
    """Broadcast a list of tensors from ``root_rank`` in one op."""
    api.runtime("broadcast()")
    tensors = [_as_tensor(t) for t in tensors]
    if not tensors:
        return []

    def fn(arrays):
        return [h.wait() for h in api.grouped_broadcast_async(arrays, root_rank, names)]

    return _run_numpy(fn, tensors, [t.dtype for t in tensors], [t.shape for t in tensors], names[0])


def allgather_tensor(tensor, name):
    """Concatenate every rank's tensor along dimension 0."""
    api.runtime("allgather()")
    tensor = _as_tensor(tensor)
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:]) if tensor.shape.rank else tensor.shape
    return _run_numpy(lambda a: [api.allgather(a[0], name)], [tensor], [tensor.dtype], [shape], name)[0]


def np_dtype(dtype) -> np.dtype:
    return np.dtype(tf.as_dtype(dtype).as_numpy_dtype)
