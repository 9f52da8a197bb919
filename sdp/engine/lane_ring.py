"""The fast lane's shared memory (:mod:`sdp.engine.lane`'s bottom part): the layout of each rank's
lane region and flag-page slots, the constants every part of the lane shares, and the readers and
writers of that memory: records, allocation in the data ring, flow control (room to post), the
doorbells, signatures.  Kept apart so the parts above (decisions, reductions, batches, the calls
run in the caller) read and write the memory one way; :class:`LaneRing` is a mixin of
:class:`sdp.engine.lane.Lane` (its methods use the Lane's attributes) and imports nothing of the
lane's other parts.

Shared memory (per rank, in its segment's lane region of :data:`shm_ctrl.LANE_BYTES`): records
``(signature, data offset, bytes)`` for :data:`DEPTH` positions, rank 0's decisions for
:data:`DEPTH` positions, then a data ring of :data:`DATA_BYTES`.  In the flag page: ``POSTED``
(positions posted), ``DONE`` (positions consumed: a decision read and, if FAST, the peers' copies
reduced), ``DECIDED`` (rank 0: positions decided), ``AWAKE`` (callers polling now), ``RUNG``,
``WAITING`` (callers asleep on lane handles), ``LATEST`` and ``JOINED`` (1 + the position of
this rank's latest lane request or ``join()``, and of its ``join()``), ``CLAIM`` (rank 0: no
rank consumes a position below it before rank 0 decided it).  Rank 0 decides at once
what a rank holds a request at (``LATEST``); positions only the engine runs are decided, and
consumed, lazily, :data:`_BACKLOG` at a time, and a burst's at once (as far as the furthest
rank's records are 0).  A rank posts
``p`` only when every rank has consumed ``p - DEPTH`` (so records, decisions and data are reused
only after every reader is done), and frees its copy of ``p`` once every rank consumed ``p``.
Stores become visible in order on x86-64 (as for the barrier flags, :mod:`sdp.engine.barrier`):
a record is written before its count.
"""
import hashlib
import threading
import time
from typing import Optional

from sdp.common import errors
from sdp.common.reduce_ops import UFUNCS, ReduceOp
from sdp.transport.shm_ctrl import LANE_BYTES

DEPTH = 256  # positions a rank may run ahead of the slowest rank's consumption
_REC = 3  # int64 per record: signature, data offset, bytes
DATA_BYTES = LANE_BYTES - DEPTH * 8 * (_REC + 1)  # each rank's data ring (records, decisions before)
READ_BYTES = 512 << 10  # eligible: bytes x (size - 1) at most this (every rank reads every copy)
NOW_READ_BYTES = 1 << 20  # the same for a synchronous allreduce (allreduce_now)
SPIN_S = 200e-6  # seconds a waiting caller polls the lane before it sleeps on the handle
GRACE_S = 200e-6  # seconds after a post during which the engine thread leaves the lane to the caller
POSTED, DONE, DECIDED, AWAKE, RUNG, WAITING, LATEST, JOINED, CLAIM = range(8, 17)  # int64 slots of the flag page
FAST, SLOW, OFF = 1, 2, 3  # decisions
JOIN_SIG = -1  # the signature of a join() record
PART_SIG = -2  # the record of a batch's request after its first (decided SLOW, and ignored)
_BATCH_MAX = DEPTH // 2  # requests in one batch
_ALIGN = 64  # bytes: every copy in the data ring starts on a cache line
_SIGS_MAX = 4096  # signatures remembered (by Request.key())
_BACKLOG = DEPTH // 4  # positions only the engine runs that are decided (consumed) in bulk, lazily

_NATIVE_DTYPES = {"<f4": 0, "<f8": 1, "<i4": 2, "<i8": 3}  # what the compiled step reduces (its codes)
_NATIVE_OPS = {ReduceOp.AVERAGE: 0, ReduceOp.SUM: 0, ReduceOp.MIN: 1, ReduceOp.MAX: 2, ReduceOp.PRODUCT: 3}
_NATIVE_PYTHON, _NATIVE_RECORD = -1, -2  # the compiled step's other answers (see cc/lane_now.c)

_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory fence: a lock's atomic instruction (x86-64: locked instructions order every
    earlier store before every later load)."""
    _fence_lock.acquire()
    _fence_lock.release()


def signature(cache: dict, key: tuple) -> int:
    """A positive 62-bit hash of ``key``'s repr (a collective's signature, the same on every
    rank for equal keys), remembered in ``cache`` (emptied at :data:`_SIGS_MAX` entries)."""
    sig = cache.get(key)
    if sig is None:
        if len(cache) >= _SIGS_MAX:
            cache.clear()
        digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
        sig = cache[key] = (int.from_bytes(digest, "little") >> 2) | 1
    return sig


class LaneRing:
    """The lane's memory, one rank's view (a mixin of :class:`sdp.engine.lane.Lane`): doorbells,
    room to post, signatures and eligibility, allocation in the data ring, and reading the
    records of a position."""

    def _ring_sleepers(self) -> None:
        """After a post of something rank 0 decides at once (not rank 0's): ring a rank whose
        caller sleeps on a lane handle if it is rank 0 (it decides) or it posted as far (it may
        consume at once); the others run the lane when they post or wait."""
        _fence()
        for q in range(self.size):
            if q != self.rank and self.page[q][WAITING] and (q == 0 or self.page[q][POSTED] >= self._posted):
                self._ring(q)

    def _call_rank0(self) -> None:
        """Ring rank 0 if it has positions of ours to decide (after a fence)."""
        if self.rank != 0 and self.page[0][DECIDED] < self._posted:
            self._ring(0)

    def _ring(self, q: int) -> None:
        """Ring rank ``q``'s doorbell unless a caller of it polls the lane or it was rung and
        has not looked yet (call after a fence that follows the stores it must see)."""
        page = self.page[q]
        if not page[AWAKE] and not page[RUNG]:
            page[RUNG] = 1
            self._ring_bell(q)  # (nothing once the mesh is closed)

    def _set_awake(self, delta: int) -> None:
        with self.lock:
            self._awake += delta
            self.page[self.rank][AWAKE] = self._awake

    def _full(self, last: int) -> bool:
        """Whether posting up to position ``last`` must first wait for room (some rank has not
        consumed ``last - DEPTH``)."""
        return last - DEPTH >= self._floor and last - DEPTH >= self._min_done()

    def _min_done(self) -> int:
        """Positions every rank has consumed (also kept as ``_floor``)."""
        page = self.page
        self._floor = floor = min(page[q][DONE] for q in range(self.size))
        return floor

    def _reducible(self, req, limit: int = READ_BYTES) -> bool:
        """Whether the lane can run allreduce ``req`` itself: a host array of a numeric dtype, an
        op it reduces, no prescale, and every rank's copy readable (bytes x (size - 1) at most
        ``limit``)."""
        a = req.array
        return (self.enabled and req.kind == "allreduce" and req.device is None and req.prescale == 1.0
                and req.op in UFUNCS and (a.dtype.kind in "fiu" or a.dtype.name == "bfloat16")
                and 0 < a.nbytes * (self.size - 1) <= limit)

    def _signature(self, req, limit: int = READ_BYTES) -> int:
        """Positive for an eligible allreduce (see :meth:`_reducible`) or broadcast, else 0."""
        if not (self._reducible(req, limit) or req.kind == "broadcast" and self.enabled and req.device is None
                and 0 < req.array.nbytes <= READ_BYTES and req.root in self.rec):  # (a bad root: the engine's error)
            return 0
        return self._sig(req.key())

    def _sig(self, key: tuple) -> int:
        """The signature of a :meth:`Request.key` (a positive 62-bit hash, remembered)."""
        return signature(self._sigs, key)

    def _wait_room(self, ahead: int = 0) -> None:
        """Wait (running the lane) until every rank has consumed position ``p - DEPTH``, ``p``
        being ``ahead`` positions past this rank's next (read again after each wait: another
        thread of this rank may post, or take :meth:`allreduce_now`, while the lock is let go)."""
        deadline = time.monotonic() + self.timeout_s
        while (p := self._posted + ahead) - DEPTH >= self._min_done():
            self._progress()
            if self.failed is not None:
                raise self.failed
            late = [q for q in range(self.size) if self.page[q][DONE] <= p - DEPTH]
            _fence()
            for q in late:  # their engines consume what no caller of theirs waits on
                if q != self.rank:
                    self._ring(q)
            self._call_rank0()  # (and rank 0 decides what we wait on)
            if time.monotonic() > deadline:
                raise errors.CollectiveTimeoutError(
                    f"rank {self.rank}: ranks {late} did not run the fast lane's position {p - DEPTH} "
                    f"within {self.timeout_s:g} s")
            self._nap()

    def _nap(self) -> None:
        """(The lock held.)  Let the lock go for ~50 us, so other threads of this rank run the lane."""
        self.lock.release()
        try:
            time.sleep(50e-6)
        finally:
            self.lock.acquire()

    def _alloc(self, nbytes: int, p: int) -> Optional[int]:
        """Offset in this rank's data ring for ``nbytes`` of position ``p``, or None (full).
        (With the compiled step, its Context keeps this state and runs this.)"""
        if self._ctx is not None:
            return self._ctx.alloc(nbytes, p)
        need = -(-nbytes // _ALIGN) * _ALIGN
        w = self._w
        off = w % DATA_BYTES
        if off + need > DATA_BYTES:
            w, off = w + DATA_BYTES - off, 0
        ext = self._extents
        if w + need - self._tail > DATA_BYTES or len(ext) > DEPTH // 4:
            done = self._min_done()  # free the copies every rank has consumed
            while ext and ext[0][0] < done:
                self._tail = ext.popleft()[1]
            if w + need - self._tail > DATA_BYTES:
                return None
        self._w = w + need
        ext.append((p, self._w))
        return off

    def _equal(self, p: int) -> bool:
        """Whether every rank posted position ``p`` with this rank's record."""
        page, i = self.page, (p % DEPTH) * _REC
        sig = self.rec[self.rank][i]
        for q in range(self.size):
            if page[q][POSTED] <= p or self.rec[q][i] != sig:
                return False
        return True
