"""``horovod.runner.common`` on sdp: only :mod:`.util` (``env``, ``settings``, ``hosts``), the part
of Horovod's launcher internals that user scripts and test helpers import."""
