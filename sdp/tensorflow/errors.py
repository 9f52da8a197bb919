"""TensorFlow's error classes for sdp's errors, as Horovod's TensorFlow ops raise them.

Horovod's ops fail with a TensorFlow status: ranks that disagree on a tensor's shape, dtype, op or
root rank get ``tf.errors.FailedPreconditionError``; bad arguments (a rank outside the process
set it calls, alltoall splits that do not add up) get ``tf.errors.InvalidArgumentError``.  sdp's
TensorFlow face raises these classes with sdp's message (tensor name, ranks, values), and they
are also sdp's own classes, so both ``except tf.errors.FailedPreconditionError`` and ``except
sdp.errors.SdpError`` (``TensorMismatchError``) catch them:

- :class:`TensorMismatchError`: ``tf.errors.FailedPreconditionError`` and
  :class:`sdp.common.errors.TensorMismatchError` (so also ``SdpError``, ``ValueError``).
- :class:`AlltoallSplitsError`: ``tf.errors.InvalidArgumentError`` and sdp's ``TensorMismatchError``.
- :class:`InvalidCollectiveError` (a rank outside the set): ``tf.errors.InvalidArgumentError``,
  ``SdpError`` and ``ValueError``.

Where: eagerly, every collective of :mod:`sdp.tensorflow`.  In ``tf.function`` and
``tf.compat.v1`` graphs the collectives are ``tf.numpy_function`` ops, whose Python errors
TensorFlow turns into a status by their Python class only (``ValueError`` ->
``InvalidArgumentError``, anything else -> ``UnknownError``; there is no way to set another code
without a compiled op), so there a mismatch is ``tf.errors.InvalidArgumentError`` carrying sdp's
message, and a rank outside a set still gets :class:`InvalidCollectiveError` when the op is built.
"""
import contextlib

import tensorflow as tf

from sdp.common import errors as _errors


class _FromMessage:
    """Mixin of the classes below: built from sdp's message alone (the ``OpError``'s ``node_def``
    and ``op`` are None), printed as that message, and picklable."""
    _op_error = tf.errors.OpError  # the TensorFlow class whose constructor is used

    def __init__(self, message: str):
        self._op_error.__init__(self, None, None, message)

    def __str__(self):
        return self.message

    def __reduce__(self):
        return type(self), (self.message,)


class TensorMismatchError(_FromMessage, tf.errors.FailedPreconditionError, _errors.TensorMismatchError):
    """Ranks disagree on a collective (shape, dtype, op, root rank, scale factors): Horovod's
    ``tf.errors.FailedPreconditionError``, also :class:`sdp.common.errors.TensorMismatchError`."""
    _op_error = tf.errors.FailedPreconditionError


class InvalidCollectiveError(_FromMessage, tf.errors.InvalidArgumentError, _errors.SdpError, ValueError):
    """A collective called with arguments Horovod rejects (a rank outside the process set it
    calls): ``tf.errors.InvalidArgumentError``, also :class:`sdp.common.errors.SdpError` and
    ``ValueError`` (what sdp raised before)."""
    _op_error = tf.errors.InvalidArgumentError


class AlltoallSplitsError(_FromMessage, tf.errors.InvalidArgumentError, _errors.TensorMismatchError):
    """A rank's alltoall ``splits`` do not add up to its first dimension (or are not one per
    rank): Horovod's ``tf.errors.InvalidArgumentError``, also
    :class:`sdp.common.errors.TensorMismatchError` (every rank raises it)."""
    _op_error = tf.errors.InvalidArgumentError


def as_tf_error(e: BaseException) -> BaseException:
    """The TensorFlow-classed counterpart of ``e`` (itself when there is none)."""
    if isinstance(e, tf.errors.OpError):
        return e
    if isinstance(e, _errors.TensorMismatchError):
        if str(e).startswith("alltoall of") and "splits must be" in str(e):
            return AlltoallSplitsError(str(e))
        return TensorMismatchError(str(e))
    return e


@contextlib.contextmanager
def tf_errors():
    """Re-raise sdp's errors of the block as :func:`as_tf_error` says (the original as ``__cause__``)."""
    try:
        yield
    except _errors.TensorMismatchError as e:
        new = as_tf_error(e)
        if new is e:
            raise
        raise new.with_traceback(e.__traceback__) from e
