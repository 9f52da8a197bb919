"""KungFu's PyTorch API on sdp: mirrors ``kungfu.torch`` (``kungfu.torch.ops`` and
``kungfu.torch.optimizers``); ``sdprun --compat kungfu`` makes it importable under that name.

As KungFu's, importing it joins the cluster (``sdp_kungfu_bridge.python``).  Tensors reach the
engine through ``sdp.torch.tensors`` (CPU tensors as views of their memory, CUDA tensors
through sdp's device path).
"""
import sdp_kungfu_bridge.python  # noqa: F401  (joins the cluster, as kungfu.torch does)
from sdp_kungfu_bridge.torch import ops  # noqa: F401
