"""KungFu's TensorFlow API on sdp: mirrors ``kungfu.tensorflow``.

Submodules: ``.ops`` (operators), ``.optimizers`` (distributed optimizers),
``.initializer`` (variable broadcast).  Importing this package joins the cluster, like
``kungfu.python``; with several workers on this host it also turns TensorFlow's thread spinning
off, as ``sdp.tensorflow.init()`` does (see ``sdp.tensorflow.threads``).
"""
from sdp_kungfu_bridge import python as _python  # noqa: F401  (joins the cluster)
from sdp_kungfu_bridge.python import (current_cluster_size, current_local_rank,  # noqa: F401
                                      current_local_size, current_rank, detached, run_barrier)
from sdp.tensorflow import threads as _threads

_threads.configure(current_local_size())
