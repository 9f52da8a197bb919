"""SageMaker data parallel's module names where its rules differ from sdp's (used by :mod:`sdp.compat`).

Under ``sdprun --compat smdistributed`` (or ``sdp.compat.install("smdistributed")``)
``smdistributed.dataparallel.tensorflow`` is :mod:`sdp.compat_smddp.tensorflow` and
``smdistributed.dataparallel.tensorflow.keras`` is :mod:`sdp.compat_smddp.keras`:
:mod:`sdp.tensorflow` and :mod:`sdp.tensorflow.keras` with SMDDP's ``init()``, which raises
:class:`~sdp.common.errors.AlreadyInitializedError` ("init() called more than once.
smdistributed.dataparallel is already initialized.") on an initialized process.  Under sdp's own
names and Horovod's a second ``init()`` is a no-op.  Every other name in them *is* sdp's object;
their submodules (``smdistributed.dataparallel.tensorflow.<sub>``) are ``sdp.tensorflow.<sub>``.
"""
from sdp.common.errors import AlreadyInitializedError


def smddp_init(face_init):
    """``face_init`` under SMDDP's rule: raise ``AlreadyInitializedError`` when sdp is initialized."""
    def init(*args, **kwargs):
        """Initialize sdp.  Mirrors ``smdistributed.dataparallel.tensorflow.init``: a second call
        raises :class:`~sdp.common.errors.AlreadyInitializedError`; otherwise as
        :func:`sdp.tensorflow.init`."""
        from sdp import api
        if api.is_initialized():
            raise AlreadyInitializedError()
        face_init(*args, **kwargs)
    return init
