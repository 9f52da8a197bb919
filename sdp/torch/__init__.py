"""The PyTorch face of sdp: ``horovod.torch``'s API on sdp's engine (issue 52).

``import sdp.torch as hvd`` where a script had ``import horovod.torch as hvd``.  torch tensors go
to :mod:`sdp.api` through :mod:`sdp.torch.tensors` (CPU tensors as numpy views, CUDA tensors
through the device path, results as tensors on the input's device, without copies).
"""
from sdp.torch import tensors  # noqa: F401
