"""``horovod.runner.util`` on sdp: :mod:`~sdp.compat_horovod.runner.util.threads`."""
