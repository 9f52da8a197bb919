"""SageMaker data parallel's module names where its rules differ from sdp's (used by ``sdp.compat``).

Under ``sdprun --compat smdistributed`` (or ``sdp.compat.install("smdistributed")``)
``smdistributed.dataparallel.tensorflow`` is ``sdp.compat_smddp.tensorflow`` and
``smdistributed.dataparallel.tensorflow.keras`` is ``sdp.compat_smddp.keras``:
``sdp.tensorflow`` and ``sdp.tensorflow.keras`` with SMDDP's ``init()``, which raises
``AlreadyInitializedError`` ("init() called more than once.
smdistributed.dataparallel is already initialized.") on an initialized process.  Under sdp's own
names and Horovod's a second ``init()`` is a no-op.  Every other name in them *is* sdp's object;
their submodules (``smdistributed.dataparallel.tensorflow.<sub>``) are ``sdp.tensorflow.<sub>``.
"""
from sdp.common.errors import AlreadyInitializedError


def smddp_init(face_init):
    """``face_init`` under SMDDP's rule: raise ``AlreadyInitializedError`` when sdp is initialized."""
    def init(*args, **kwargs):
        """Initialize sdp.  Mirrors ``smdistributed.dataparallel.tensorflow.init``: a second call
        raises ``AlreadyInitializedError``; otherwise as
        ``sdp.tensorflow.init``."""
        from sdp import api
        if api.is_initialized():
            raise AlreadyInitializedError()
        face_init(*args, **kwargs)
    return init


def forwarding(face, alias: str, namespace: dict):
    """``(__getattr__, __dir__)`` of a module ``alias`` whose names are ``namespace`` (its
    globals) and then ``face``'s (names added to ``face`` later appear too)."""
    def __getattr__(name):
        try:
            return getattr(face, name)
        except AttributeError:
            raise AttributeError(f"module {alias!r} (sdp) has no attribute {name!r}") from None

    def __dir__():
        return sorted(set(namespace) | set(dir(face)))

    return __getattr__, __dir__
