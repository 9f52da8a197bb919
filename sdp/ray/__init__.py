"""sdp on a Ray cluster: :class:`RayExecutor`, mirroring ``horovod.ray.RayExecutor``.

Needs Ray (``pip install "sdp[ray]"``); importing this package without it raises ImportError.
"""
from sdp.ray.runner import RayExecutor, RaySettings

__all__ = ["RayExecutor", "RaySettings"]
