"""``horovod.runner.common.util`` on sdp: ``env``, ``settings`` and ``hosts`` with Horovod's public
names (what makes sense without MPI or horovodrun's driver)."""
