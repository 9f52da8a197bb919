"""sdp import shim for ``mindspore`` under ``sdprun --compat``: loads the real MindSpore in its place
and, with ``--compat kungfu``, adds the KungFu fork's module names (see sdp.compat)."""
__sdp_compat__ = "shim"
if "." not in __name__:
    import _sdp_compat_boot
    _sdp_compat_boot.activate(__name__)
