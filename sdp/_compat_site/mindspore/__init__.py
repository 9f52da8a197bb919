"""sdp import shim for ``mindspore`` under ``sdprun --compat``: loads the real MindSpore in its place
and, with ``--compat kungfu``, adds the KungFu fork's module names (see sdp.compat) and its
``mindspore._c_expression.kungfu_*`` functions."""
__sdp_compat__ = "shim"
if "." not in __name__:
    import _sdp_compat_boot
    _sdp_compat_boot.activate(__name__)  # the real MindSpore is sys.modules["mindspore"] now
    import sdp.compat
    if "kungfu" in sdp.compat.installed():
        from sdp_kungfu_bridge.mindspore import add_c_expression_functions
        add_c_expression_functions()
