"""Horovod's elastic TensorFlow API (``horovod.tensorflow.elastic``): not yet supported by sdp.

Under ``sdprun --compat horovod`` the module ``horovod.tensorflow.elastic`` is this one, so a script
that imports it loads; using any of its names (``run``, ``TensorFlowKerasState``,
``TensorFlowState``) raises ``NotImplementedError`` naming the API, until sdp's elastic mode for
Horovod scripts exists.  (KungFu-style elasticity is in ``sdp_kungfu_bridge`` and
``sdprun -w``.)
"""

__all__ = ["run", "TensorFlowKerasState", "TensorFlowState"]


def _unsupported(api_name: str) -> NotImplementedError:
    return NotImplementedError(f"horovod.tensorflow.elastic.{api_name}: not yet supported by sdp")


def run(func):
    """Horovod's elastic training decorator.  Raises ``NotImplementedError`` (not yet supported)."""
    raise _unsupported("run")


class TensorFlowKerasState:
    """Horovod's elastic state of a Keras model and optimizer.  Creating one raises
    ``NotImplementedError`` (not yet supported)."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        raise _unsupported("TensorFlowKerasState")


class TensorFlowState:
    """Horovod's elastic state of a list of variables.  Creating one raises
    ``NotImplementedError`` (not yet supported)."""

    def __init__(self, variables=None, session=None, **kwargs):
        raise _unsupported("TensorFlowState")
