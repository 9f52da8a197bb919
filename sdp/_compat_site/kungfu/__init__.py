"""sdp import shim for ``kungfu`` under ``sdprun --compat``: see _sdp_compat_boot and sdp.compat."""
__sdp_compat__ = "shim"
if "." not in __name__:
    import _sdp_compat_boot
    _sdp_compat_boot.activate(__name__)
