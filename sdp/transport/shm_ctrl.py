"""Control messages between the ranks of one host through shared memory, with a pipe doorbell.

When every rank of a job is on this host (the mesh maps every peer's segment, see
:mod:`sdp.transport.shm`), the engine's control messages (negotiation requests, responses,
stall aborts) skip ZeroMQ: each ordered pair of ranks has a single-producer single-consumer
ring of :data:`RING_BYTES` in the *sender's* segment, and the sender then writes one byte to
the receiver's **doorbell**: the write end of the pipe the receiver's engine thread already
polls beside its sockets (its wake-up pipe), opened by the peers as ``/proc/<pid>/fd/<fd>``
(the same user only, as for the memfd segments; the path travels in the authenticated
rendezvous).  One message then costs one wake-up of the receiving engine thread instead of
four thread hand-offs through two ZeroMQ I/O threads.  Nothing is named in a file system,
so nothing outlives the job, however it ends: the rings are part of the memfd segments, the
doorbell is a pipe.  Fault detection is unchanged: the engine thread waits in the same
``poll`` as before, which still sees the ZeroMQ monitors of every peer.

Layout: in the last page of every segment (the barrier-flag page; barrier flags use its first 8
slots, the fast lane slots 8-16), int64 slot ``WPOS + dst`` is how many bytes this rank has written into its ring to
``dst`` (written only by the sender), ``RPOS + src`` how many bytes this rank has read from
``src``'s ring to it (written only by the receiver), ``MODE`` is 1 once this rank sends its
control messages through the rings.  A record is ``u32 length, u32 k`` then the body, padded to
8 bytes; ``WRAP`` as length: the rest of the ring is skipped.  ``k`` numbers the messages of one
ordered pair (mod 2**32): a body larger than half the ring, or one that finds the ring full,
travels over ZeroMQ with ``k`` as its ``seq``, and the receiver takes messages in ``k`` order from
either (so a sender never waits for room, and two ranks sending to each other cannot block each
other).  Ordering: the sender writes the record before its position, and x86-64 keeps stores in
order (as for the barrier flags, :mod:`sdp.engine.barrier`); other CPUs keep ZeroMQ.
"""
import logging
import os
import platform
import struct
import threading
from typing import Dict, List, Optional

import numpy as np

log = logging.getLogger("sdp.transport")

RING_BYTES = 64 << 10  # per ordered pair of ranks
#: bytes of every segment with rings for the fast lane (:mod:`sdp.engine.lane`): its records,
#: decisions and data ring
LANE_BYTES = (2 << 20) + (16 << 10)
MAX_RANKS = 64  # jobs of more ranks on one host keep ZeroMQ for control (64 x 64 KiB per segment)
STORES_ORDERED = platform.machine().lower() in ("x86_64", "amd64")
WPOS, RPOS, MODE = 64, 64 + MAX_RANKS, 63  # int64 slots of the flag page (module docstring)
PAGE_SLOTS = 512
_HEAD = struct.Struct("<II")
WRAP, ZMQ_NEXT = 0xFFFFFFFF, 0xFFFFFFFE


def usable(size: int) -> bool:
    """Whether a job of ``size`` ranks, all on this host, can keep its control in shared memory."""
    return STORES_ORDERED and 1 < size <= MAX_RANKS and os.path.isdir(f"/proc/{os.getpid()}/fd")


def bell_path(bell_w: int) -> str:
    """The path under which same-user peers open this process's doorbell (a pipe's write end)."""
    return f"/proc/{os.getpid()}/fd/{bell_w}"


def open_bell(path: str) -> int:
    """Open a peer's doorbell for writing (non-blocking); raises ``OSError``."""
    return os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)


def ring_bell(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except (BlockingIOError, BrokenPipeError):  # full: it wakes anyway; gone: the mesh sees it
        pass


class ControlRings:
    """This rank's rings to and from every peer of ``seg`` (:class:`shm.SharedSegments` made with
    ``rings``), and the peers' doorbells (rank -> fd; empty: this rank sends over ZeroMQ)."""

    def __init__(self, seg, rank: int, bells: Dict[int, int]):
        self.seg, self.rank, self.bells = seg, rank, bells
        self._bells_lock = threading.Lock()  # a ring and the close never overlap (see ring)
        # memoryviews, not numpy: a slice assignment or an item costs ~0.1 us instead of ~1 us
        self.page = {r: memoryview(seg.at(r, seg.nbytes - seg.FLAGS, np.int64, PAGE_SLOTS)).cast("B").cast("q")
                     for r in seg.peers}
        self._rings: Dict[tuple, memoryview] = {}
        self._wpos: Dict[int, int] = {r: 0 for r in seg.peers}
        self._rpos: Dict[int, int] = {r: 0 for r in seg.peers}
        self._next_out: Dict[int, int] = {r: 0 for r in seg.peers}  # k of the next message to r
        self._next_in: Dict[int, int] = {r: 0 for r in seg.peers}  # k expected next from r
        self.senders: Dict[int, bool] = {}  # peer -> it sends to us through its ring (ready())

    def start(self) -> None:
        """Announce that this rank sends through the rings from now on (before its HELLOs)."""
        if self.bells:
            self.page[self.rank][MODE] = 1

    def ready(self) -> None:
        """Read which peers send through their rings (after their HELLOs arrived)."""
        self.senders = {r: self.page[r][MODE] == 1 for r in self.seg.peers if r != self.rank}

    def _ring(self, owner: int, dst: int) -> memoryview:
        ring = self._rings.get((owner, dst))
        if ring is None:
            ring = self._rings[owner, dst] = memoryview(
                self.seg.at(owner, self.seg.ring_offset(dst), np.uint8, RING_BYTES))
        return ring

    def send(self, dst: int, body: bytes) -> Optional[int]:
        """Put ``body`` into the ring to ``dst`` and ring its doorbell: returns None; or, when it
        does not fit (larger than half the ring, or the ring is full), returns the number ``k``
        the caller must send it with over ZeroMQ (as ``seq``)."""
        k = self._next_out[dst]
        self._next_out[dst] = (k + 1) & 0xFFFFFFFF
        n = len(body)
        need = 8 + (-(-n // 8) * 8)
        w = self._wpos[dst]
        free = RING_BYTES - (w - self.page[dst][RPOS + self.rank])
        off = w % RING_BYTES
        skip = RING_BYTES - off if off + need > RING_BYTES else 0
        if need > RING_BYTES // 2 or skip + need > free:
            return k
        ring = self._ring(self.rank, dst)
        if skip:
            _HEAD.pack_into(ring, off, WRAP, 0)
            w, off = w + skip, 0
        ring[off + 8:off + 8 + n] = body
        _HEAD.pack_into(ring, off, n, k)
        w += need
        self._wpos[dst] = w
        self.page[self.rank][WPOS + dst] = w  # last: the record is visible before its position
        self.ring(dst)
        return None

    def ring(self, dst: int) -> None:
        """Ring ``dst``'s doorbell (any thread; nothing once :meth:`close` ran).  The descriptor is
        looked up and written under the lock :meth:`close` takes: a number closed between the two
        is soon another file's (a stray byte once aborted TensorFlow)."""
        with self._bells_lock:
            fd = self.bells.get(dst)
            if fd is not None:
                ring_bell(fd)

    def recv(self, src: int, zmq_box) -> List[bytes]:
        """The bodies ``src`` has sent to this rank since the last call, in order, from its ring
        and from ``zmq_box`` (the ZeroMQ control inbox of ``src``: deque of ``(aux, seq, frames)``):
        stops at the first missing number (a message still on its way over ZeroMQ)."""
        r = start = self._rpos[src]
        w = self.page[src][WPOS + self.rank]
        if r == w and not zmq_box:
            return []
        out = []
        ring = self._ring(src, self.rank)
        k = self._next_in[src]
        while True:
            if r < w:
                off = r % RING_BYTES
                n, rk = _HEAD.unpack_from(ring, off)
                if n == WRAP:
                    r += RING_BYTES - off
                    continue
                if off + 8 + n > RING_BYTES:
                    log.warning("rank %d: malformed control ring record from rank %d (length %d); ring dropped",
                                self.rank, src, n)
                    r = w
                    continue
                if rk == k:
                    out.append(bytes(ring[off + 8:off + 8 + n]))
                    r += 8 + (-(-n // 8) * 8)
                    k = (k + 1) & 0xFFFFFFFF
                    continue
            if zmq_box and (zmq_box[0][1] & 0xFFFFFFFF) == k:
                frames = zmq_box.popleft()[2]
                out.append(frames[0].bytes if frames else b"")
                k = (k + 1) & 0xFFFFFFFF
                continue
            break
        self._next_in[src] = k
        if r != start:
            self._rpos[src] = r
            self.page[self.rank][RPOS + src] = r  # the sender may reuse the space now
        return out

    def close(self) -> None:
        """Close the peers' doorbells (emptying the dict in place: a :meth:`ring` after the close
        finds no number)."""
        with self._bells_lock:
            while self.bells:
                _, fd = self.bells.popitem()
                try:
                    os.close(fd)
                except OSError:
                    pass
