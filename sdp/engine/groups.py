"""Process groups: a subset of a job's ranks seen as a mesh of its own, and the two kinds of group
the hierarchical allreduce and allgather use (Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE`` layout).

A :class:`Group` has the interface the algorithms of :mod:`sdp.engine.collectives` and
:mod:`sdp.engine.barrier` are written against (``rank size shm send recv pump lost peer_error
stopping timeout_s hand_off sendrecv_done``), with group-local ranks ``0 .. len(ranks)-1``
mapped to the job's ranks, so the ring, recursive doubling, broadcast and shared-memory
algorithms run unchanged on a subset of ranks.  Each group stamps its tag into the high bits of
every message ``seq`` (:data:`TAG_SHIFT`), so two groups that share a pair of ranks and run the
same collective never take each other's messages for their own.

:class:`Hierarchy` is this rank's place in the job's hosts: its **host group** (the ranks of its
host, in rank order, with the host's shared-memory segments) and one **cross group** per part of
a buffer it owns (the owners of that part on every host, in host order).  A buffer is split into
``M`` parts, ``M`` the largest number of ranks on one host; on a host of ``L`` ranks part ``j``
belongs to local rank ``j % L``, so uneven hosts (2+1+2 ranks) work: the lone rank of a host
owns every part and joins every cross group.
"""
import logging
from typing import List, Optional, Sequence

log = logging.getLogger("sdp.engine")

TAG_SHIFT = 48  # a group's messages carry seq | tag << TAG_SHIFT (engine seqs stay far below 2**48)


class GroupSegments:
    """A host's :class:`~sdp.transport.shm.SharedSegments` indexed by group-local rank."""

    def __init__(self, segments, ranks: Sequence[int]):
        self._seg, self._ranks = segments, list(ranks)

    slab_bytes = property(lambda self: self._seg.slab_bytes)
    pool = property(lambda self: self._seg.pool)

    @property
    def barriers(self) -> int:
        return self._seg.barriers

    @barriers.setter
    def barriers(self, value: int) -> None:
        self._seg.barriers = value

    def claim(self) -> int:
        return self._seg.claim()

    def pool_offset(self, arr):
        return self._seg.pool_offset(arr)

    def half(self, q: int, which: int, dtype, count: int):
        return self._seg.half(self._ranks[q], which, dtype, count)

    def at(self, q: int, offset: int, dtype, count: int):
        return self._seg.at(self._ranks[q], offset, dtype, count)

    def flags(self, q: int):
        return self._seg.flags(self._ranks[q])


class Group:
    """The ranks ``ranks`` (job ranks, this one among them) of ``mesh`` as a mesh of their own:
    group rank ``i`` is job rank ``ranks[i]``.  ``segments``: the shared-memory segments of
    these ranks (all on one host), or None.  ``tag`` (1 .. 2**16-1) tells this group's messages
    apart from those of other groups and of the whole job."""

    def __init__(self, mesh, ranks: Sequence[int], tag: int, segments=None):
        self.mesh, self.ranks, self.tag = mesh, list(ranks), tag
        self.rank, self.size = self.ranks.index(mesh.rank), len(self.ranks)
        self.shm = None if segments is None else GroupSegments(segments, self.ranks)
        self._base = tag << TAG_SHIFT

    lost = property(lambda self: self.mesh.lost)  # job ranks: any loss fails every collective
    stopping = property(lambda self: self.mesh.stopping)
    timeout_s = property(lambda self: self.mesh.timeout_s)

    def send(self, dst: int, kind: int, seq: int = 0, aux: int = 0, payload=None):
        return self.mesh.send(self.ranks[dst], kind, self._base | seq, aux, payload)

    def recv(self, src: int, kind: int, seq: Optional[int] = None, aux: Optional[int] = None,
             deadline: Optional[float] = None):
        return self.mesh.recv(self.ranks[src], kind, None if seq is None else self._base | seq, aux, deadline)

    def pump(self, timeout_ms):
        self.mesh.pump(timeout_ms)

    def peer_error(self):
        return self.mesh.peer_error()

    def hand_off(self):
        self.mesh.hand_off()

    def sendrecv_done(self, trackers):
        self.mesh.sendrecv_done(trackers)


#: Largest slab of a hierarchical collective (bytes).  Smaller slabs pipeline the phases better
#: where the link between hosts is the bottleneck: 2 emulated hosts x 2 ranks on a 2 Gbit/s link,
#: 64 MB allreduce, alternating runs: 8 MB slabs 284-294 ms (96-99% of the link's ceiling), 4 MB
#: 281-288 ms, 32 MB 306-319 ms (89-92%); 1 Gbit/s: 8 MB 565 ms vs 64 MB 589 ms.
CROSS_SLAB_BYTES = 8 << 20


class Hierarchy:
    """This rank's host group (``host``) and cross groups (``cross[j]`` for each part ``j`` in
    ``parts``, the parts of ``M`` = ``nparts`` this rank owns), built from every rank's host name.

    ``hosts``: the host name of every job rank (index = rank).  ``segments``: this host's shared
    segments (:attr:`Mesh.host_shm`), required when this host has more than one rank.
    ``slab_bytes``: the shared-memory slab size (the same on every rank); buffers are cut on every
    host alike into slabs of at most that and :data:`CROSS_SLAB_BYTES`."""

    def __init__(self, mesh, hosts: List[str], segments=None, slab_bytes: int = 32 << 20):
        order = list(dict.fromkeys(hosts))  # hosts in the order of their first rank
        #: the ranks of every host, in rank order; hosts in the order of their first rank
        self.members = members = [[r for r, h in enumerate(hosts) if h == host] for host in order]
        self.nparts = max(len(m) for m in members)
        mine = members[order.index(hosts[mesh.rank])]
        self.host = Group(mesh, mine, self.nparts + 1, segments if len(mine) > 1 else None)
        local, size = self.host.rank, self.host.size
        #: owner (group-local rank on this host) of every part
        self.owner = [j % size for j in range(self.nparts)]
        self.parts = [j for j in range(self.nparts) if self.owner[j] == local]
        self.cross = {j: Group(mesh, [m[j % len(m)] for m in members], 1 + j) for j in self.parts}
        # a collective's slab: the same on every rank (SDP_SHM_SLAB_BYTES, at most CROSS_SLAB_BYTES)
        self.slab_bytes = min(slab_bytes, CROSS_SLAB_BYTES)
        self.allreduces = self.allgathers = 0  # hierarchical collectives run (for tests and benchmarks)

    @classmethod
    def build(cls, mesh, hosts: List[str], setting: Optional[bool], slab_bytes: int) -> Optional["Hierarchy"]:
        """The hierarchy to run allreduces through, or None for the flat algorithms.

        ``setting`` (:attr:`Config.hierarchical`): False off; True or None (automatic) on wherever
        there is a hierarchy: ranks on more than one host and some host with several (else the
        flat algorithms are the same or, on one host, shared memory is better).  On needs every
        rank of a host with several ranks to have shared memory (else off, with a warning when
        asked for).  Every rank decides alike: from the host names and shared-memory paths all
        ranks registered (and ``setting``, which must be the same on every rank, as Horovod
        requires of its ``HOROVOD_*`` variables)."""
        if mesh.size == 1 or len(hosts) != mesh.size or mesh.shm is not None or setting is False:
            return None
        counts = {h: hosts.count(h) for h in hosts}
        if len(counts) == 1 or max(counts.values()) == 1:
            return None
        shared = all(p.get("shm") for p, h in zip(mesh.peers, hosts) if counts[h] > 1)
        if not shared or (counts[hosts[mesh.rank]] > 1 and mesh.host_shm is None):
            if setting:
                log.warning("rank %d: hierarchical allreduce asked for, but some host's ranks have no shared "
                            "memory: flat algorithms instead", mesh.rank)
            return None
        return cls(mesh, hosts, mesh.host_shm, slab_bytes)
