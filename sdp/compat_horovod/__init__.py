"""Horovod's module paths that have no natural home in sdp's layers (used by ``sdp.compat``).

Under ``sdprun --compat horovod`` (or ``sdp.compat.install("horovod")``):

- ``horovod.tensorflow`` is ``sdp.compat_horovod.tensorflow`` and ``horovod.tensorflow.keras`` /
  ``horovod.keras`` are ``sdp.compat_horovod.keras``: ``sdp.tensorflow`` and
  ``sdp.tensorflow.keras`` plus Horovod's process-set names.  Everything in them *is* sdp's
  object (same functions and classes, so ``isinstance`` holds).
- ``horovod.runner`` is ``sdp.compat_horovod.runner`` (``run``, ``util.threads``).

Their submodules (``horovod.tensorflow.util``, ``.mpi_ops``, ``.functions``, ``.compression``,
``.elastic``, ``horovod.tensorflow.keras.callbacks``) are sdp's own modules
(``sdp.tensorflow.util``, ...), and ``horovod.common.util`` / ``horovod.common.exceptions`` are
``sdp.common.util`` / ``sdp.common.errors``.
"""
