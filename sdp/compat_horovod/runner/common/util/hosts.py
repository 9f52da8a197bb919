"""``horovod.runner.common.util.hosts`` on sdp: host strings and rank placement with Horovod's
names, computed by :mod:`sdp.launcher.hosts` (the placement ``sdprun`` uses: each host's slots
filled in order; ``cross_rank`` is a host's index among the hosts that have that local rank).

- ``HostInfo(hostname, slots)``, ``HostInfo.from_string("host:slots")``.
- ``SlotInfo`` (``hostname, rank, local_rank, cross_rank, size, local_size, cross_size``;
  ``to_response_string()`` is ``"rank,size,local_rank,local_size,cross_rank,cross_size"``),
  ``INVALID_SLOT_INFO`` (every number -1).
- ``parse_hosts(s)``: ``"a:2,b:2"`` -> list of ``HostInfo``; ``parse_hosts_and_slots(s)``:
  ``(names, {name: slots})`` (``ValueError`` for an entry not of the form ``name:slots``);
  ``parse_host_files(path)``: a hostfile of ``name slots=N`` lines -> ``"name:N,..."``.
- ``get_host_assignments(hosts, min_np, max_np=None)``: one ``SlotInfo`` per rank, filling the
  hosts in order up to ``max_np`` ranks; ``ValueError`` if fewer than ``min_np`` slots.

Mirrors Horovod's module.
"""
import re
from dataclasses import dataclass

from sdp.launcher import hosts as _hosts


class HostInfo:
    """A host and its number of slots."""

    def __init__(self, hostname, slots):
        self.hostname = hostname
        self.slots = slots

    @staticmethod
    def from_string(host_string):
        hostname, slots = host_string.strip().split(":")
        return HostInfo(hostname, int(slots))


@dataclass
class SlotInfo:
    """Where one rank runs and its place in the job."""
    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int

    def to_response_string(self):
        return ",".join(str(v) for v in (self.rank, self.size, self.local_rank, self.local_size, self.cross_rank,
                                         self.cross_size))


INVALID_SLOT_INFO = SlotInfo(hostname="", rank=-1, local_rank=-1, cross_rank=-1, size=-1, local_size=-1,
                             cross_size=-1)


def parse_host_files(filename):
    """A hostfile of ``<host> slots=<n>`` lines as ``"host:n,..."``."""
    out = []
    with open(filename) as f:
        for line in f:
            line = line.rstrip()
            if line:
                out.append(f"{line.split()[0]}:{line.split('=')[1]}")
    return ",".join(out)


def parse_hosts_and_slots(hosts):
    """``("a:2,b:1")`` -> ``(["a", "b"], {"a": 2, "b": 1})``; ``ValueError`` for a bad entry."""
    names, slots = [], {}
    pattern = re.compile(r"^[\w.-]+:[0-9]+$")
    for host in hosts.split(","):
        if not pattern.match(host.strip()):
            raise ValueError("Invalid host input, please make sure it has format as : worker-0:2,worker-1:2.")
        name, n = host.strip().split(":")
        names.append(name)
        slots[name] = int(n)
    return names, slots


def parse_hosts(hosts_string):
    """``"a:2,b:2"`` -> ``[HostInfo("a", 2), HostInfo("b", 2)]``."""
    return [HostInfo.from_string(h) for h in hosts_string.split(",")]


def get_host_assignments(hosts, min_np, max_np=None):
    """One :class:`SlotInfo` per rank over ``hosts`` (``HostInfo`` list), as many as there are
    slots, at most ``max_np``; ``ValueError`` if that is fewer than ``min_np``."""
    total = sum(h.slots for h in hosts)
    n = total if max_np is None else min(total, max_np)
    if n < min_np:
        raise ValueError(f"Requested more processes ({min_np}) than there are available slots ({n})")
    infos = _hosts.assign_ranks([_hosts.HostSlots(h.hostname, h.slots) for h in hosts], n) if n else []
    return [SlotInfo(hostname=i.hostname, rank=i.rank, local_rank=i.local_rank, cross_rank=i.cross_rank,
                     size=i.size, local_size=i.local_size, cross_size=i.cross_size) for i in infos]
