"""Horovod Elastic's host discovery script: run it, parse its ``host[:slots]`` lines.

``horovodrun --host-discovery-script S`` (and ``sdprun``'s) runs ``S`` about once a second; it
prints the hosts the job may use now, one per line as ``host:slots`` or ``host`` (then
``--slots-per-host`` slots, default 1).  ``#`` starts a comment, blank lines are skipped, a line
that does not parse is logged (once per distinct line) and skipped; output of which no line parses
is an error (``ValueError``), so a script printing something else fails at once instead of
leaving the job without hosts until ``--elastic-timeout``.  Names of this machine (``localhost``, its host name,
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


def run_script(script: str, timeout_s: Optional[float] = None) -> str:
    """The standard output of ``script``, which may take ``timeout_s`` (default
    :data:`SCRIPT_TIMEOUT_S`).  Raises ``OSError`` / ``subprocess.SubprocessError``
    (``CalledProcessError`` on a non-zero status, ``TimeoutExpired``)."""
    timeout_s = SCRIPT_TIMEOUT_S if timeout_s is None else timeout_s
    return subprocess.run([script], capture_output=True, text=True, timeout=timeout_s, check=True).stdout


def parse(text: str, slots_per_host: Optional[int], max_np: int, allow_fake: bool = False,
          names: Optional[Iterable[str]] = None, warned: Optional[set] = None) -> Dict[str, int]:
    """``{host: slots}`` from the script's output (see the module docstring), hosts in the order
    of their first line; a host on several lines adds up.  ``warned``: the lines already logged as
    unparsable (not logged again).  Raises ``ValueError`` when lines are there and none parses."""
    names = hostlib.local_names() if names is None else set(names)
    found: Dict[str, int] = {}
    bad = []
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
        if not h or slots is None or len(h.split()) > 1:  # (no host name holds a space)
            bad.append(line[:200])
            if warned is None or line[:200] not in warned:
                if warned is not None and len(warned) < 1000:
                    warned.add(line[:200])
                log.warning("host discovery: cannot parse %r (expected host:slots)", line[:200])
            continue
        if not allow_fake and hostlib.is_local(h, names):
            h = LOCALHOST
        found[h] = min(max_np, found.get(h, 0) + max(slots, 0))
    if bad and not found:
        raise ValueError(f"no line of its output is host[:slots] (the first: {bad[0]!r})")
    return found
