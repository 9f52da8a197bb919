"""Horovod's elastic Keras API (``horovod.tensorflow.keras.elastic`` / ``horovod.keras.elastic``):
not yet supported by sdp.

Under ``sdprun --compat horovod`` those modules are this one: importing works, and using a name
(``run``, ``KerasState``, ``CommitStateCallback``, ``UpdateBatchStateCallback``,
``UpdateEpochStateCallback``) raises ``NotImplementedError`` naming the API (see
:mod:`sdp.tensorflow.elastic`).
"""
from sdp.tensorflow.elastic import TensorFlowKerasState, run  # noqa: F401

__all__ = ["run", "KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback"]


def _unsupported(api_name: str) -> NotImplementedError:
    return NotImplementedError(f"horovod.tensorflow.keras.elastic.{api_name}: not yet supported by sdp")


class KerasState:
    """Horovod's elastic Keras state.  Creating one raises ``NotImplementedError``."""

    def __init__(self, model, optimizer=None, **kwargs):
        raise _unsupported("KerasState")


class CommitStateCallback:
    """Horovod's elastic commit callback.  Creating one raises ``NotImplementedError``."""

    def __init__(self, state, batches_per_commit=1):
        raise _unsupported("CommitStateCallback")


class UpdateBatchStateCallback:
    """Horovod's elastic batch callback.  Creating one raises ``NotImplementedError``."""

    def __init__(self, state):
        raise _unsupported("UpdateBatchStateCallback")


class UpdateEpochStateCallback:
    """Horovod's elastic epoch callback.  Creating one raises ``NotImplementedError``."""

    def __init__(self, state):
        raise _unsupported("UpdateEpochStateCallback")
