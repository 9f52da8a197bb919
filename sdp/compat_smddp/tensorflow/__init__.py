"""``smdistributed.dataparallel.tensorflow`` on sdp: ``sdp.tensorflow`` with SMDDP's ``init()``
(a second call raises ``AlreadyInitializedError``; see ``sdp.compat_smddp``).  Every other name
is ``sdp.tensorflow``'s own object, looked up there (names added later appear here too)."""
import sdp.tensorflow as _face
from sdp.compat_smddp import smddp_init as _smddp_init
from sdp.tensorflow import *  # noqa: F401,F403

__all__ = list(_face.__all__)
init = _smddp_init(_face.init)


def __getattr__(name):
    try:
        return getattr(_face, name)
    except AttributeError:
        raise AttributeError(f"module 'smdistributed.dataparallel.tensorflow' (sdp) has no attribute {name!r}") \
            from None


def __dir__():
    return sorted(set(globals()) | set(dir(_face)))
