"""``horovod.tensorflow`` on sdp: ``sdp.tensorflow`` plus Horovod's low-level names.

``init()`` is ``sdp.tensorflow.init`` (Horovod's rule: a second call is a no-op).  Process
sets (``ProcessSet``, ``add_process_set``, ``remove_process_set``, ``global_process_set``) are
``sdp.process_sets``'s.  Every other name is ``sdp.tensorflow``'s own
object, looked up there (names added to ``sdp.tensorflow`` later appear here too), then in
``sdp.tensorflow.mpi_ops`` (Horovod's low-level names; process sets).  This is a
package only so that ``horovod.tensorflow.<sub>`` can be imported; ``sdp.compat`` maps those
submodules to ``sdp.tensorflow.<sub>``.
"""
import sdp.tensorflow as _face
from sdp.tensorflow import *  # noqa: F401,F403
from sdp.tensorflow import elastic  # noqa: F401  (Horovod's hvd.elastic.run, ...)
from sdp.tensorflow import mpi_ops as _mpi_ops
from sdp.tensorflow.mpi_ops import ProcessSet, add_process_set, remove_process_set  # noqa: F401

__all__ = list(_face.__all__) + ["ProcessSet", "add_process_set", "remove_process_set"]


def __getattr__(name):
    """sdp.tensorflow's name, else horovod.tensorflow.mpi_ops's (Horovod's low-level names)."""
    for module in (_face, _mpi_ops):
        try:
            return getattr(module, name)
        except AttributeError:
            pass
    raise AttributeError(f"module 'horovod.tensorflow' (sdp) has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(dir(_face)))
