"""Shared-memory segments for ranks on the same host.

Each rank creates one segment of ``2 * slab_bytes + pool_bytes + 4096`` bytes, advertises its path
at rendezvous, and maps every same-host peer's segment.  On Linux the segment is an anonymous
``memfd`` (named ``sdp-<job>-<rank>`` in ``/proc/<pid>/fd``, mode 0600) that peers open through
``/proc/<pid>/fd/<fd>`` (which needs the same user, as ``ptrace``'s read check): it has no name in
any file system, so nothing of it can outlive the processes that map it, however they end
(``kill -9`` of ``sdprun`` or of every rank during start-up left 192 MiB per rank in
``/dev/shm`` when segments were named files there).  Elsewhere (no ``memfd_create`` or no
``/proc``) it is a file ``/dev/shm/sdp-<job>-<rank>-<pid>`` (0600, ``O_EXCL``), unlinked as soon
as every peer has mapped it; a rank killed before that leaves it to the sweeps below
(:func:`remove_job_files`, :func:`remove_orphans`).  Control messages
travel in rings in the segments when every rank is on this host (:mod:`sdp.transport.shm_ctrl`),
lost peers are seen by ZeroMQ; the barriers between a collective's phases are flags in the
segments' last page where the CPU allows it (:mod:`sdp.engine.barrier`).

Layout of a segment: two staging halves of ``slab_bytes`` (used alternately, so one barrier per
slab is enough between reuse), then a :class:`ResultPool` of ``pool_bytes``: result arrays that
peers write reduced chunks into directly, handed to the caller without a copy-out; then, when
made with ``rings``, one control ring per rank of the job (:mod:`sdp.transport.shm_ctrl`) and the
fast lane's region of :data:`shm_ctrl.LANE_BYTES` (:mod:`sdp.engine.lane`); then one page of
barrier flags (:meth:`SharedSegments.flags`), ring positions and the lane's counters.
"""
import bisect
import glob
import logging
import mmap
import os
import threading
import weakref
from typing import Optional, Tuple

import numpy as np

log = logging.getLogger("sdp.transport")

SHM_DIR = "/dev/shm"
FLAGS_BYTES = 4096  # the barrier-flag page at the end of every segment


def available() -> bool:
    return hasattr(mmap, "MAP_SHARED") and (
        _memfd_usable() or (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)))


def _memfd_usable() -> bool:
    """Whether segments can be memfds that peers open as ``/proc/<pid>/fd/<fd>``."""
    return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")


def _create_memfd(name: str, nbytes: int) -> Tuple[int, np.ndarray]:
    """A new memfd of ``nbytes`` (0600, space reserved: ENOSPC/ENOMEM now, not SIGBUS later),
    mapped; returns ``(fd, array)``.  The caller closes ``fd`` once peers have opened it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)
        os.posix_fallocate(fd, 0, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise
    return fd, np.frombuffer(mm, dtype=np.uint8)


def _map(path: str, nbytes: int, create: bool) -> np.ndarray:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now, not SIGBUS on first touch later
        # no MAP_POPULATE: mapping every peer's result pool up front costs ~0.1 s per rank at
        # init; pages are mapped on first touch instead (once, in the first collectives)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.uint8)


def remove_job_files(job: str) -> int:
    """Unlink every segment file of job ``job`` still in /dev/shm (a rank killed between
    creating its segment and every peer mapping it leaves one behind); returns how many."""
    return _unlink_job_files(job, "*", lambda path: True)


def _unlink_job_files(job: str, rest: str, chosen) -> int:
    """Unlink the files ``/dev/shm/sdp-<job>-<rest>`` for which ``chosen(path)``; returns how many."""
    removed = 0
    for path in glob.glob(os.path.join(SHM_DIR, f"sdp-{glob.escape(job)}-{rest}")):
        if chosen(path):
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
    return removed


def process_state(pid) -> Optional[str]:
    """The state letter of process ``pid`` on this host from ``/proc/<pid>/stat`` (R, S, D, T
    stopped, t traced, Z zombie...), or None if there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:][:1].decode()
    except (OSError, ValueError, TypeError):
        return None


def remove_orphans(job: str) -> int:
    """Unlink the segment files of job ``job`` whose creator (the pid in the name) is dead: a
    rank killed between creating its segment and every peer mapping it.  Called by a rank
    whose start-up failed, which also covers jobs started without ``sdprun`` (whose sweep,
    :func:`remove_job_files`, needs it to outlive the job).  Returns how many."""
    def dead_creator(path: str) -> bool:
        pid = path.rsplit("-", 1)[1]
        return pid.isdigit() and process_state(pid) in (None, "Z", "X")

    return _unlink_job_files(job, "*-*", dead_creator)


class ResultPool:
    """First-fit allocator of result arrays in this rank's segment, ``[base, base + nbytes)``.

    :meth:`alloc` hands out a numpy array backed by the segment; its block returns to the pool
    when that array (and every view of it) is garbage collected, so a result stays valid, and is
    never written by a peer again, for as long as the caller holds it.  Thread-safe: arrays may
    die on any thread."""

    ALIGN = 4096  # bytes: blocks never share a cache line (or a page) with one another

    def __init__(self, mm: mmap.mmap, base: int, nbytes: int):
        self._mm, self._lock = mm, threading.Lock()
        self._free = [(base, base + nbytes)] if nbytes > 0 else []  # sorted, coalesced [start, end)

    def alloc(self, dtype, count: int) -> Optional[Tuple[int, np.ndarray]]:
        """``(offset, array)``: a 1-D array of ``count`` elements of ``dtype`` at byte ``offset``
        of the segment, or ``None`` when no free block is large enough."""
        dtype = np.dtype(dtype)
        size = -(-max(count * dtype.itemsize, 1) // self.ALIGN) * self.ALIGN
        with self._lock:
            for i, (start, end) in enumerate(self._free):
                if end - start >= size:
                    self._free[i:i + 1] = [(start + size, end)] if end - start > size else []
                    break
            else:
                return None
        arr = np.frombuffer(self._mm, dtype=dtype, count=count, offset=start)  # base: the mmap
        weakref.finalize(arr, self._release, start, start + size).atexit = False
        return start, arr

    def _release(self, start: int, end: int) -> None:
        with self._lock:
            i = bisect.bisect(self._free, (start, end))
            if i < len(self._free) and self._free[i][0] == end:  # merge with the next block
                end = self._free.pop(i)[1]
            if i > 0 and self._free[i - 1][1] == start:  # and with the previous one
                start = self._free[i - 1][0]
                i -= 1
                self._free.pop(i)
            self._free.insert(i, (start, end))

    def free_bytes(self) -> int:
        with self._lock:
            return sum(end - start for start, end in self._free)


class SharedSegments:
    """This rank's segment (``mine``) and views of same-host peers' segments (``peers[rank]``)."""

    FLAGS = FLAGS_BYTES

    def __init__(self, job: str, rank: int, slab_bytes: int, pool_bytes: int = 0, rings: int = 0):
        """Create this rank's segment: two halves of ``slab_bytes``, a result pool of
        ``pool_bytes`` (dropped, with a warning, if /dev/shm has no room for it) and ``rings``
        control rings of :data:`shm_ctrl.RING_BYTES` (one per rank of the job, or 0).  Raises
        ``OSError`` (e.g. ENOSPC when /dev/shm is small) if even the halves do not fit."""
        from sdp.transport.shm_ctrl import LANE_BYTES, RING_BYTES
        self.slab_bytes = slab_bytes
        self.rings = rings
        self.lane_bytes = LANE_BYTES if rings else 0  # the fast lane's region (sdp.engine.lane)
        self._tail_bytes = rings * RING_BYTES + self.lane_bytes  # (after the pool)
        self._fd = None  # the memfd, open until every peer has opened it (unlink())
        memfd = _memfd_usable()
        self.path = None if memfd else os.path.join(SHM_DIR, f"sdp-{job}-{rank}-{os.getpid()}")
        for pool in ((pool_bytes, 0) if pool_bytes > 0 else (0,)):
            self.nbytes = 2 * slab_bytes + pool + self._tail_bytes + FLAGS_BYTES
            try:
                if memfd:
                    self._fd, self.mine = _create_memfd(f"sdp-{job}-{rank}", self.nbytes)
                    self.path = f"/proc/{os.getpid()}/fd/{self._fd}"
                else:
                    self.mine = _map(self.path, self.nbytes, create=True)
                break
            except OSError as e:
                if not memfd:
                    try:
                        os.unlink(self.path)
                    except OSError:
                        pass
                if pool == 0:
                    raise
                log.warning("rank %d: no room for a %d-byte result pool in shared memory (%s); results are "
                            "copied out of shared memory", rank, pool, e)
        self.pool = ResultPool(self.mine.base, 2 * slab_bytes, pool) if pool else None
        self.peers = {rank: self.mine}
        self._unlinked = False
        self._uses = 0
        self.barriers = 0  # flag barriers this rank has posted (sdp.engine.barrier)
        self._flags = {}  # rank -> flags() view

    def claim(self) -> int:
        """The half (0/1) the next slab must use: halves alternate over the whole job, the same
        sequence on every rank because all ranks run the same collectives in the same order."""
        self._uses += 1
        return self._uses % 2

    def attach(self, rank: int, path: str) -> None:
        self.peers[rank] = _map(path, self.nbytes, create=False)
        self._flags.pop(rank, None)

    def unlink(self) -> None:
        """Drop this segment's name (the /dev/shm file, or the memfd's descriptor): call once
        every peer has mapped it; the mappings stay valid."""
        if not self._unlinked:
            self._unlinked = True
            if self._fd is not None:
                os.close(self._fd)
                return
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def half(self, rank: int, which: int, dtype, count: int) -> np.ndarray:
        """``count`` elements of ``dtype`` in half ``which`` (0/1) of ``rank``'s segment."""
        return self.at(rank, which * self.slab_bytes, dtype, count)

    def pool_offset(self, arr: np.ndarray) -> Optional[int]:
        """Byte offset of ``arr`` in this rank's segment if it lies in the result pool, else None."""
        if self.pool is None:
            return None
        off = arr.__array_interface__["data"][0] - self.mine.__array_interface__["data"][0]
        end = self.nbytes - FLAGS_BYTES - self._tail_bytes
        return off if 2 * self.slab_bytes <= off and off + arr.nbytes <= end else None

    def ring_offset(self, dst: int) -> int:
        """Byte offset, in any rank's segment, of that rank's control ring to rank ``dst``."""
        from sdp.transport.shm_ctrl import RING_BYTES
        return self.nbytes - FLAGS_BYTES - self._tail_bytes + dst * RING_BYTES

    def lane_offset(self) -> int:
        """Byte offset, in any rank's segment, of that rank's fast-lane region (``lane_bytes``)."""
        return self.nbytes - FLAGS_BYTES - self.lane_bytes

    def flags(self, rank: int) -> np.ndarray:
        """``rank``'s barrier flags: 8 int64 slots in its segment's last page, written only by
        ``rank`` (see :mod:`sdp.engine.barrier`).  One view per rank, made on first use: every
        barrier reads them."""
        view = self._flags.get(rank)
        if view is None:
            view = self._flags[rank] = self.at(rank, self.nbytes - FLAGS_BYTES, np.int64, 8)
        return view

    def at(self, rank: int, offset: int, dtype, count: int) -> np.ndarray:
        """``count`` elements of ``dtype`` at byte ``offset`` of ``rank``'s segment."""
        return self.peers[rank][offset:offset + count * np.dtype(dtype).itemsize].view(dtype)
