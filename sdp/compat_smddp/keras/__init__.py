"""``smdistributed.dataparallel.tensorflow.keras`` on sdp: ``sdp.tensorflow.keras`` with SMDDP's
``init()`` (a second call raises ``AlreadyInitializedError``; see ``sdp.compat_smddp``).  Every
other name is ``sdp.tensorflow.keras``'s own object."""
import sdp.tensorflow.keras as _face
from sdp.compat_smddp import smddp_init as _smddp_init
from sdp.tensorflow.keras import *  # noqa: F401,F403

__all__ = list(_face.__all__)
init = _smddp_init(_face.init)


def __getattr__(name):
    try:
        return getattr(_face, name)
    except AttributeError:
        raise AttributeError(f"module 'smdistributed.dataparallel.tensorflow.keras' (sdp) has no attribute "
                             f"{name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(dir(_face)))
