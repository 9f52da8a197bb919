"""``smdistributed.dataparallel.tensorflow`` on sdp: ``sdp.tensorflow`` with SMDDP's ``init()``
(a second call raises ``AlreadyInitializedError``; see ``sdp.compat_smddp``).  Every other name
is ``sdp.tensorflow``'s own object, looked up there (names added later appear here too)."""
import sdp.tensorflow as _face
from sdp.compat_smddp import forwarding as _forwarding
from sdp.compat_smddp import smddp_init as _smddp_init
from sdp.tensorflow import *  # noqa: F401,F403

__all__ = list(_face.__all__)
init = _smddp_init(_face.init)

__getattr__, __dir__ = _forwarding(_face, "smdistributed.dataparallel.tensorflow", globals())
