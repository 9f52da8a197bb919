"""sdp import shim: on PYTHONPATH only in the workers of ``sdprun --compat``; see sdp.compat.

Imported as a top-level package, it hands over to ``sdp.compat._activate_shim``, which makes this
the sdp-backed package (if ``SDP_COMPAT`` enables it), or loads a real installation in its place
(with a warning unless ``SDP_COMPAT_FORCE`` says to use sdp), or fails like a missing module."""
__sdp_compat__ = "shim"

if "." not in __name__:
    import _sdp_compat_boot

    _sdp_compat_boot.activate(__name__)
