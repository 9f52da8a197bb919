"""``kungfu.tensorflow.v1.ops``: the names of ``kungfu.tensorflow.ops`` (older KungFu code imports
them from here), i.e. ``sdp_kungfu_bridge.tensorflow.ops``."""
from sdp_kungfu_bridge.tensorflow.ops import *  # noqa: F401,F403
from sdp_kungfu_bridge.tensorflow.ops import __all__  # noqa: F401
