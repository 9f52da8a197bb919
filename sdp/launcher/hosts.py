"""Host lists for ``sdprun``: parse ``-H``/``--hostfile`` and assign ranks (pure functions).

Ranks are assigned host by host, filling each host's slots in order (Horovod semantics):

* ``local_rank`` is the index of a rank among the ranks on the same host, ``local_size`` the
  number of ranks on that host;
* ``cross_rank`` is the index of the host among the hosts that have a rank with that
  ``local_rank``, ``cross_size`` the number of such hosts.

Example: ``-H a:2,b:2 -np 4`` gives local ranks 0,1,0,1, cross ranks 0,0,1,1, cross size 2.
"""
import socket
from typing import Iterable, List, NamedTuple, Optional

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1", "localhost.localdomain")


class HostSlots(NamedTuple):
    """A host name and how many ranks (slots) it may run."""
    host: str
    slots: int


class RankInfo(NamedTuple):
    """Where one rank runs and its place in the topology (the ``SDP_*`` variables)."""
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str

    def env(self) -> dict:
        """The ``SDP_*`` topology variables of this rank, as strings, and the same values under
        the names ``horovodrun`` gives every worker (``HOROVOD_RANK``, ``HOROVOD_SIZE``,
        ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE``, ``HOROVOD_CROSS_RANK``,
        ``HOROVOD_CROSS_SIZE``, ``HOROVOD_HOSTNAME``), which scripts and test helpers read.
        (sdp itself reads ``SDP_*`` first, see :mod:`sdp.common.topology`.)"""
        values = {"RANK": self.rank, "SIZE": self.size, "LOCAL_RANK": self.local_rank,
                  "LOCAL_SIZE": self.local_size, "CROSS_RANK": self.cross_rank, "CROSS_SIZE": self.cross_size,
                  "HOSTNAME": self.hostname}
        env = {f"SDP_{k}": str(v) for k, v in values.items()}
        env.update({f"HOROVOD_{k}": str(v) for k, v in values.items()})
        return env


def _parse_slots(text: str, where: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise ValueError(f"{where}: slot count {text!r} is not an integer") from None
    if slots < 1:
        raise ValueError(f"{where}: slot count must be at least 1, got {slots}")
    return slots


def _check_unique(hosts: List[HostSlots], where: str) -> List[HostSlots]:
    seen = set()
    for h in hosts:
        if h.host in seen:
            raise ValueError(f"{where}: host {h.host!r} is listed more than once")
        seen.add(h.host)
    if not hosts:
        raise ValueError(f"{where}: no hosts given")
    return hosts


def parse_hosts(spec: str) -> List[HostSlots]:
    """Parse Horovod/KungFu ``-H`` syntax ``host1:slots,host2:slots`` (``host`` alone = 1 slot).

    Raises ``ValueError`` on an empty list, a bad or non-positive slot count, or a host given twice.
    """
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        host, sep, slots = item.partition(":")
        host = host.strip()
        if not host or ":" in slots:
            raise ValueError(f"-H {spec!r}: cannot parse {item!r}; expected host:slots")
        hosts.append(HostSlots(host, _parse_slots(slots.strip(), f"-H {spec!r}") if sep else 1))
    return _check_unique(hosts, f"-H {spec!r}")


def parse_hostfile_text(text: str, name: str = "hostfile") -> List[HostSlots]:
    """Parse hostfile contents: one host per line as ``host slots=N``, ``host:N`` or ``host``
    (1 slot).  ``#`` starts a comment; blank lines are skipped; other ``key=value`` fields
    (e.g. ``max_slots=``) are ignored.  Raises ``ValueError`` naming the line on a parse error."""
    hosts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{name}:{lineno}"
        fields = line.split()
        host, sep, slots_text = fields[0].partition(":")
        slots = _parse_slots(slots_text, where) if sep else 1
        for field in fields[1:]:
            key, eq, value = field.partition("=")
            if not eq:
                raise ValueError(f"{where}: cannot parse {line!r}; expected 'host slots=N' or 'host:N'")
            if key == "slots":
                slots = _parse_slots(value, where)
        if not host:
            raise ValueError(f"{where}: missing host name in {line!r}")
        hosts.append(HostSlots(host, slots))
    return _check_unique(hosts, name)


def parse_hostfile(path: str) -> List[HostSlots]:
    """Read and parse a hostfile (see :func:`parse_hostfile_text`).  Raises ``OSError`` if it
    cannot be read, ``ValueError`` if it cannot be parsed."""
    with open(path, encoding="utf-8") as f:
        return parse_hostfile_text(f.read(), name=path)


def local_names() -> set:
    """Names that mean "this machine": localhost, loopback addresses and this host's name."""
    names = set(LOCAL_NAMES)
    hostname = socket.gethostname()
    names.update({hostname, hostname.split(".", 1)[0]})
    return names


def is_local(host: str, names: Optional[Iterable[str]] = None) -> bool:
    """True if ``host`` names this machine (``names`` defaults to :func:`local_names`)."""
    names = local_names() if names is None else set(names)
    return host in names or host.startswith("127.")


def total_slots(hosts: List[HostSlots]) -> int:
    """Sum of the slots of ``hosts``."""
    return sum(h.slots for h in hosts)


def assign_ranks(hosts: List[HostSlots], np: int) -> List[RankInfo]:
    """Place ``np`` ranks on ``hosts``, host by host, filling slots in order.

    Hosts left without a rank (``np`` smaller than the slot total) do not count in
    ``cross_size``.  Returns one :class:`RankInfo` per rank, indexed by rank.  Raises
    ``ValueError`` if ``np < 1`` or ``np`` exceeds the total number of slots.
    """
    if np < 1:
        raise ValueError(f"number of processes must be at least 1, got {np}")
    available = total_slots(hosts)
    if np > available:
        listing = ",".join(f"{h.host}:{h.slots}" for h in hosts)
        raise ValueError(f"-np {np} exceeds the {available} slots of the hosts ({listing})")
    per_host = []  # (host, number of ranks on it)
    left = np
    for h in hosts:
        if left == 0:
            break
        n = min(h.slots, left)
        per_host.append((h.host, n))
        left -= n
    infos = []
    rank = 0
    for host_index, (host, n) in enumerate(per_host):
        for local_rank in range(n):
            # hosts that have this local_rank, in host order: those with more than local_rank ranks
            having = [i for i, (_, m) in enumerate(per_host) if m > local_rank]
            infos.append(RankInfo(rank=rank, size=np, local_rank=local_rank, local_size=n,
                                  cross_rank=having.index(host_index), cross_size=len(having),
                                  hostname=host))
            rank += 1
    return infos
