"""Names of the drop-in compatibility families, shared by the launcher and :mod:`sdp.compat`.

``sdprun --compat`` (:mod:`sdp.launcher.cli`) checks its value and puts :data:`SHIM_DIR` on the
workers' ``PYTHONPATH``; :mod:`sdp.compat` maps the module names.  Kept here, below both, so the
launcher never imports the faces.
"""
import os
from typing import Iterable, Tuple, Union

FAMILIES = ("horovod", "smdistributed", "kungfu")
COMPAT_ENV = "SDP_COMPAT"
FORCE_ENV = "SDP_COMPAT_FORCE"
#: the directory whose ``sitecustomize``-style shim activates ``SDP_COMPAT`` in a worker
SHIM_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_compat_site")


def parse_families(value: Union[str, Iterable[str], None]) -> Tuple[str, ...]:
    """``"horovod,kungfu"`` / ``["horovod"]`` / ``"all"`` -> a tuple of family names, in
    :data:`FAMILIES` order.  Raises ``ValueError`` naming an unknown family."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    names = set()
    for item in items:
        item = str(item).strip().lower()
        if not item:
            continue
        if item == "all":
            names.update(FAMILIES)
        elif item in FAMILIES:
            names.add(item)
        else:
            raise ValueError(f"unknown compatibility family {item!r}; choose from {', '.join(FAMILIES)} "
                             f"(comma-separated) or 'all'")
    return tuple(f for f in FAMILIES if f in names)
