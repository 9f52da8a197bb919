"""``horovod.tensorflow.keras`` / ``horovod.keras`` on sdp: ``sdp.tensorflow.keras`` plus
Horovod's process-set names (``init()`` is sdp's: a second call is a no-op, as in Horovod).  Every
other name is ``sdp.tensorflow.keras``'s own object; ``horovod.tensorflow.keras.<sub>`` (e.g.
``callbacks``) is ``sdp.tensorflow.keras.<sub>``."""
import sdp.tensorflow.keras as _face
from sdp.tensorflow.keras import *  # noqa: F401,F403
from sdp.tensorflow.keras import elastic  # noqa: F401  (Horovod's hvd.elastic.KerasState, ...)
from sdp.tensorflow.mpi_ops import ProcessSet, add_process_set, remove_process_set  # noqa: F401

__all__ = list(_face.__all__) + ["ProcessSet", "add_process_set", "remove_process_set"]


def __getattr__(name):
    try:
        return getattr(_face, name)
    except AttributeError:
        raise AttributeError(f"module 'horovod.tensorflow.keras' (sdp) has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(dir(_face)))
