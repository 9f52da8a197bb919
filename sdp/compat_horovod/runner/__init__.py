"""``horovod.runner`` on sdp: ``run`` (Horovod's programmatic launcher) and ``util.threads``.

``run(func, args=(), kwargs=None, np=1, hosts=None, ...)`` is ``horovod.run``: it starts ``np``
ranks running ``func(*args, **kwargs)`` and returns their results in rank order (see
``sdp.compat.run``, imported when first called, for the arguments it takes and what it raises).
"""


def run(*args, **kwargs):
    """``horovod.runner.run`` / ``horovod.run``: see ``sdp.compat.run``."""
    from sdp.compat import run as _run
    return _run(*args, **kwargs)
