"""Shared start of the shim packages in this directory (a top-level module while the directory is
on ``PYTHONPATH``): find sdp — installed, or the copy this directory belongs to — and hand the
shim package over to :func:`sdp.compat._activate_shim`."""
import os
import sys


def activate(name: str) -> None:
    try:
        import sdp.compat as compat
    except ImportError:  # sdp itself not on sys.path: use the copy this shim belongs to
        sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        import sdp.compat as compat
    compat._activate_shim(name)
