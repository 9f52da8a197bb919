"""KungFu's API on the sdp engine: ``sdp_kungfu_bridge.python`` mirrors ``kungfu.python``,
``sdp_kungfu_bridge.tensorflow.{ops,optimizers,initializer}`` mirror ``kungfu.tensorflow.*``.

``sdprun --compat kungfu`` makes them importable under the ``kungfu`` names.  Importing this
package does not join the cluster; importing ``sdp_kungfu_bridge.python`` (or reading one of
the names below from this package, as old scripts do with ``from kungfu import current_rank``)
does.
"""
_PYTHON_NAMES = ('current_cluster_size', 'current_local_rank', 'current_local_size', 'current_rank',
                 'detached', 'run_barrier', 'resize', 'propose_new_size', 'all_reduce_int_max', 'uid')


def __getattr__(name):
    if name in _PYTHON_NAMES:
        from sdp_kungfu_bridge import python
        return getattr(python, name)
    raise AttributeError(f"module 'sdp_kungfu_bridge' has no attribute {name!r}")
