"""Horovod Elastic's host discovery script: run it, parse its ``host[:slots]`` lines.

``horovodrun --host-discovery-script S`` (and ``sdprun``'s) runs ``S`` about once a second; it
prints the hosts the job may use now, one per line as ``host:slots`` or ``host`` (then
``--slots-per-host`` slots, default 1).  ``#`` starts a comment, blank lines are skipped, a line
that does not parse is logged and skipped.  Names of this machine (``localhost``, its host name,
``127.*``) count as one host, ``localhost``, unless fake hosts are allowed
(``SDP_LAUNCHER_ALLOW_FAKE_HOSTS=1``, where every name is a pretend host on this machine).
Slots are untrusted numbers: each host's count is capped at ``max_np``, negative counts are 0.
"""
import logging
import subprocess
from typing import Dict, Iterable, Optional

from sdp.launcher import hosts as hostlib

log = logging.getLogger("sdp.launcher")

LOCALHOST = "localhost"
#: seconds one run of the script may take
SCRIPT_TIMEOUT_S = 30.0


def run_script(script: str, timeout_s: float = SCRIPT_TIMEOUT_S) -> str:
    """The standard output of ``script``.  Raises ``OSError`` / ``subprocess.SubprocessError``
    (``CalledProcessError`` on a non-zero status, ``TimeoutExpired``)."""
    return subprocess.run([script], capture_output=True, text=True, timeout=timeout_s, check=True).stdout


def parse(text: str, slots_per_host: Optional[int], max_np: int, allow_fake: bool = False,
          names: Optional[Iterable[str]] = None) -> Dict[str, int]:
    """``{host: slots}`` from the script's output (see the module docstring), hosts in the order
    of their first line; a host on several lines adds up."""
    names = hostlib.local_names() if names is None else set(names)
    found: Dict[str, int] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        h, sep, n = line.partition(":")
        h = h.strip()
        try:
            slots = int(n) if sep else (slots_per_host or 1)
        except ValueError:
            slots = None
        if not h or slots is None:
            log.warning("host discovery: cannot parse %r (expected host:slots)", line[:200])
            continue
        if not allow_fake and hostlib.is_local(h, names):
            h = LOCALHOST
        found[h] = min(max_np, found.get(h, 0) + max(slots, 0))
    return found
