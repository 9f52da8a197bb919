"""Horovod's module paths that have no natural home in sdp's layers (used by :mod:`sdp.compat`).

Under ``sdprun --compat horovod`` (or ``sdp.compat.install("horovod")``):

- ``horovod.tensorflow`` is :mod:`sdp.compat_horovod.tensorflow` and ``horovod.tensorflow.keras`` /
  ``horovod.keras`` are :mod:`sdp.compat_horovod.keras`: :mod:`sdp.tensorflow` and
  :mod:`sdp.tensorflow.keras` plus Horovod's process-set names.  Everything in them *is* sdp's
  object (same functions and classes, so ``isinstance`` holds).
- ``horovod.runner`` is :mod:`sdp.compat_horovod.runner` (``run``, ``util.threads``).

Their submodules (``horovod.tensorflow.util``, ``.mpi_ops``, ``.functions``, ``.compression``,
``.elastic``, ``horovod.tensorflow.keras.callbacks``) are sdp's own modules
(:mod:`sdp.tensorflow.util`, ...), and ``horovod.common.util`` / ``horovod.common.exceptions`` are
:mod:`sdp.common.util` / :mod:`sdp.common.errors`.
"""
