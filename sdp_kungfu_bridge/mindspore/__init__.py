"""KungFu's MindSpore face on sdp: the KungFu fork of MindSpore's modules, on the real MindSpore.

KungFu's guide for MindSpore (a distributed optimizer that allreduces gradients with
``KungFuAllReduce`` through ``C.Map``, an elastic callback that broadcasts the step and the
parameters with ``KungFuBroadcast`` and resizes the cluster with ``KungFuResize``, a launch with
``kungfu-run -w``) needed a MindSpore fork with KungFu's C++ kernels.  Here the same names run on
an unmodified MindSpore (2.10, CPU) and sdp's engine:

===========================================  =========================================
fork's module                                sdp module
===========================================  =========================================
``mindspore.ops.operations.kungfu_comm_ops``  ``sdp_kungfu_bridge.mindspore.ops``
``mindspore.nn.optim.kungfu``                 ``sdp_kungfu_bridge.mindspore.optim``
``mindspore.train.callback._kungfu``          ``sdp_kungfu_bridge.mindspore.callback``
``mindspore._c_expression.kungfu_*``          functions of ``sdp_kungfu_bridge.mindspore.ops``
===========================================  =========================================

The fork's names appear when the job runs with ``sdprun --compat kungfu`` (the shim
``mindspore`` package of ``sdp.compat`` loads the real MindSpore and adds them), or after
``install``.  MindSpore's files are never changed: the names are served by sdp's import
finder, and ``kungfu_*`` functions are added to the loaded ``mindspore._c_expression`` module
object.  A real KungFu-built MindSpore (one that has ``kungfu_comm_ops``) is left alone, with a
``sdp.compat.CompatShadowWarning`` (``SDP_COMPAT_FORCE=kungfu`` replaces it).

Needs MindSpore 2.10+ with numpy < 2 (``pip install sdp[mindspore]``: with numpy 2 a pyfunc
operator fails with "Numpy init failed").  Two MindSpore 2.10 PYNATIVE bugs are worked around
(see ``optim`` and ``callback``).
Elastic jobs: ``sdprun -w`` (KungFu's flags ``-w -builtin-config-port P -config-server URL``).
"""
import importlib

_C_FUNCTIONS = ('kungfu_init', 'kungfu_finalize', 'kungfu_current_rank', 'kungfu_current_cluster_size',
                'kungfu_nccl_init', 'kungfu_nccl_finalize')


def add_c_expression_functions() -> bool:
    """Give the loaded ``mindspore._c_expression`` the fork's ``kungfu_*`` functions (those it
    lacks).  Returns ``False`` (and adds nothing) when it has its own: a KungFu-built MindSpore."""
    c_expression = importlib.import_module("mindspore._c_expression")
    if any(getattr(getattr(c_expression, n, None), "__module__", "") not in ("", __name__ + ".ops")
           for n in _C_FUNCTIONS if hasattr(c_expression, n)):
        return False
    from sdp_kungfu_bridge.mindspore import ops
    for n in _C_FUNCTIONS:
        setattr(c_expression, n, getattr(ops, n))
    return True


def install(force=None) -> bool:
    """Make the fork's module names import as sdp's in this process (what ``sdprun --compat
    kungfu`` does in its workers); ``force`` as ``sdp.compat.install``.  Imports MindSpore.
    Returns whether the names now resolve to sdp (``False``: a KungFu-built MindSpore is used,
    with a warning, or ``kungfu`` could not be mapped)."""
    from sdp import compat
    if "kungfu" not in compat.install(("kungfu",), force=force):
        return False
    import mindspore  # noqa: F401
    if not add_c_expression_functions():
        return False
    return compat.find_real("mindspore.ops.operations.kungfu_comm_ops") is None or \
        "kungfu" in compat._forced(force)
