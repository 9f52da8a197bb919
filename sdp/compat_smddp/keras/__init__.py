"""``smdistributed.dataparallel.tensorflow.keras`` on sdp: ``sdp.tensorflow.keras`` with SMDDP's
``init()`` (a second call raises ``AlreadyInitializedError``; see ``sdp.compat_smddp``).  Every
other name is ``sdp.tensorflow.keras``'s own object."""
import sdp.tensorflow.keras as _face
from sdp.compat_smddp import forwarding as _forwarding
from sdp.compat_smddp import smddp_init as _smddp_init
from sdp.tensorflow.keras import *  # noqa: F401,F403

__all__ = list(_face.__all__)
init = _smddp_init(_face.init)

__getattr__, __dir__ = _forwarding(_face, "smdistributed.dataparallel.tensorflow.keras", globals())
