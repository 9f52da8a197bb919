"""Import shims for ``sdprun --compat``: this directory goes first on the workers' ``PYTHONPATH``
so that ``import horovod`` / ``smdistributed`` / ``kungfu`` reach sdp (see :mod:`sdp.compat`).
Imported as ``sdp._compat_site`` it does nothing."""
