"""Names of the drop-in compatibility families, shared by the launcher and ``sdp.compat``.

``sdprun --compat`` (``sdp.launcher.cli``) checks its value and puts ``SHIM_DIR`` on the
workers' ``PYTHONPATH``; ``sdp.compat`` maps the module names.  Kept here, below both, so the
launcher never imports the faces.
"""
import os
from typing import Iterable, Tuple, Union

FAMILIES = ("horovod", "smdistributed", "kungfu")
"""The compatibility families, the values of ``sdprun --compat`` (a comma list, or ``all``)."""
ALIASES = {"smddp": "smdistributed"}
"""Other names a family goes by in ``--compat`` (``smddp``, SMDDP's own short name)."""
COMPAT_ENV = "SDP_COMPAT"
"""The environment variable naming the families a worker maps (``sdprun --compat`` sets it)."""
FORCE_ENV = "SDP_COMPAT_FORCE"
"""The environment variable that maps a family over a real installation (``1`` or a comma list)."""
SHIM_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_compat_site")
"""The directory of the shim packages (``horovod/``, ...) that ``sdprun --compat`` puts first on
the workers' ``PYTHONPATH``; each activates ``SDP_COMPAT``'s mapping when imported."""


def parse_families(value: Union[str, Iterable[str], None]) -> Tuple[str, ...]:
    """``"horovod,kungfu"`` / ``["horovod"]`` / ``"all"`` -> a tuple of family names, in
    ``FAMILIES`` order (``smddp`` is ``smdistributed``).  Raises ``ValueError`` naming an
    unknown family."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    names = set()
    for item in items:
        item = str(item).strip().lower()
        item = ALIASES.get(item, item)
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
