"""TensorFlow's error classes for sdp's errors, as Horovod's TensorFlow ops raise them.

Horovod's ops fail with a TensorFlow status: ranks that disagree on a tensor's shape, dtype, op or
root rank get ``tf.errors.FailedPreconditionError``; bad arguments (a rank outside the process
set it calls, alltoall splits that do not add up) get ``tf.errors.InvalidArgumentError``.  sdp's
TensorFlow face raises these classes with sdp's message (tensor name, ranks, values), and they
are also sdp's own classes, so both ``except tf.errors.FailedPreconditionError`` and ``except
sdp.errors.SdpError`` (``TensorMismatchError``) catch them:

- ``TensorMismatchError``: ``tf.errors.FailedPreconditionError`` and
  ``sdp.common.errors.TensorMismatchError`` (so also ``SdpError``, ``ValueError``).
- ``AlltoallSplitsError``: ``tf.errors.InvalidArgumentError`` and sdp's ``TensorMismatchError``.
- ``InvalidCollectiveError`` (a rank outside the set): ``tf.errors.InvalidArgumentError``,
  ``SdpError`` and ``ValueError``.

Where: eagerly, every collective of ``sdp.tensorflow``.  In ``tf.function`` and
``tf.compat.v1`` graphs (and ``tf.data`` functions) the collectives are ``tf.numpy_function`` ops,
whose Python errors TensorFlow turns into a status by their Python class only (``ValueError`` ->
``InvalidArgumentError``, anything else -> ``UnknownError``).  So there a collective's
``numpy_function`` does not raise these errors: it hands their status (``graph_status``) to
sdp's compiled ``SdpCheck`` op (``sdp.tensorflow.build_ops``), which fails with it: TensorFlow
raises ``tf.errors.FailedPreconditionError`` / ``InvalidArgumentError`` (its own classes, not
sdp's: the call that raises is TensorFlow's) with sdp's message.  Without that library
(``SDP_TF_OPS=0``, no C++ compiler) every one of them is ``tf.errors.InvalidArgumentError`` in
graphs.  A rank outside a set gets ``InvalidCollectiveError`` when the op is built (while a
function is traced, too: AutoGraph re-raises these classes as they are).
"""

import tensorflow as tf

from sdp.common import errors as _errors


class _FromMessage:
    """Mixin of the classes below: built from sdp's message alone (the ``OpError``'s ``node_def``
    and ``op`` are None), printed as that message, and picklable.  The constructor also takes
    ``OpError``'s arguments ``(node_def, op, message, *payloads)``: AutoGraph re-raises an
    ``OpError`` from traced code (a ``tf.function``, a ``tf.data`` function) with its own class
    only when ``__init__`` has those, else as a ``StagingError``."""
    _op_error = tf.errors.OpError  # the TensorFlow class whose constructor is used

    def __init__(self, node_def=None, op=None, message=None, *args):
        if message is None and op is None and isinstance(node_def, str):  # Error("sdp's message")
            node_def, message = None, node_def
        self._op_error.__init__(self, node_def, op, message, *args)

    def __str__(self):
        return self.message

    def __reduce__(self):
        return type(self), (self.message,)


class TensorMismatchError(_FromMessage, tf.errors.FailedPreconditionError, _errors.TensorMismatchError):
    """Ranks disagree on a collective (shape, dtype, op, root rank, scale factors): Horovod's
    ``tf.errors.FailedPreconditionError``, also ``sdp.common.errors.TensorMismatchError``."""
    _op_error = tf.errors.FailedPreconditionError


class InvalidCollectiveError(_FromMessage, tf.errors.InvalidArgumentError, _errors.SdpError, ValueError):
    """A collective called with arguments Horovod rejects (a rank outside the process set it
    calls): ``tf.errors.InvalidArgumentError``, also ``sdp.common.errors.SdpError`` and
    ``ValueError`` (what sdp raised before)."""
    _op_error = tf.errors.InvalidArgumentError


class AlltoallSplitsError(_FromMessage, tf.errors.InvalidArgumentError, _errors.TensorMismatchError):
    """A rank's alltoall ``splits`` do not add up to its first dimension (or are not one per
    rank): Horovod's ``tf.errors.InvalidArgumentError``, also
    ``sdp.common.errors.TensorMismatchError`` (every rank raises it)."""
    _op_error = tf.errors.InvalidArgumentError


def graph_status(e: BaseException):
    """``e``'s TensorFlow status for sdp's compiled check op (``sdp.tensorflow.build_ops``):
    ``(code, UTF-8 message)`` when ``as_tf_error`` gives ``e`` a TensorFlow class, else None
    (the error is raised as it is, and TensorFlow maps it by its Python class)."""
    tf_e = as_tf_error(e)
    if not isinstance(tf_e, tf.errors.OpError) or not tf_e.error_code:
        return None
    return tf_e.error_code, (tf_e.message or "").encode("utf-8", "replace")


def as_tf_error(e: BaseException) -> BaseException:
    """The TensorFlow-classed counterpart of ``e`` (itself when there is none)."""
    if isinstance(e, tf.errors.OpError):
        return e
    if isinstance(e, _errors.TensorMismatchError):
        if str(e).startswith("alltoall of") and "splits must be" in str(e):
            return AlltoallSplitsError(str(e))
        return TensorMismatchError(str(e))
    return e


class _TfErrors:
    """``tf_errors``' context manager (a class: ~0.1 us to enter and leave where a
    ``contextlib`` generator costs ~0.9 us, on every eager collective)."""

    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, kind, e, tb):
        if kind is None or not issubclass(kind, _errors.TensorMismatchError):
            return False
        new = as_tf_error(e)
        if new is e:
            return False
        raise new.with_traceback(tb) from e


_TF_ERRORS = _TfErrors()


def tf_errors() -> _TfErrors:
    """A context manager: re-raise sdp's errors of the block as ``as_tf_error`` says (the
    original as ``__cause__``)."""
    return _TF_ERRORS
