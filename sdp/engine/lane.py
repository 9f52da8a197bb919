"""The fast lane: small allreduces and broadcasts between the ranks of one host without the
coordinator's round trip or the engine thread's wake-ups.

When every rank is on this host and the mesh keeps its control in shared memory
(:mod:`sdp.transport.shm_ctrl`), every collective of all ranks (process set 0) a caller submits
is first **posted** to the lane, in the caller's thread: position ``p`` (this rank's count of
posts) gets a record in this rank's lane region: a signature, and, for a collective the lane can
run (*eligible*: an allreduce of a host array, SUM/AVERAGE/MIN/MAX/PRODUCT, no prescale, its bytes
times ``size - 1`` at most :data:`READ_BYTES`, :data:`NOW_READ_BYTES` for :meth:`Lane.allreduce_now`;
a broadcast of at most :data:`READ_BYTES`), a copy
of the input in this rank's data ring (a broadcast: the root's only).  The
signature is a 62-bit hash of everything ranks must agree on (:meth:`Request.key`: name, kind,
dtype, shape, op, scales, a group's shapes); 0 marks a collective the lane does not run, which
goes to the engine at once.  A burst's small allreduces are gathered into a batch
(:mod:`sdp.engine.lane_batch`).  While the lane holds a request, what
goes to the engine waits until that request is decided (waiting on it runs the lane), so a
request decided SLOW reaches the engine before what was submitted after it and is batched with it.

:class:`Lane` is this module's: its constructor, :meth:`Lane.post` and :meth:`Lane.fail_all`;
the rest are its parts, one responsibility a module, each a mixin of :class:`Lane` that imports
downwards only (never this module):

* :mod:`sdp.engine.lane_ring`: the shared memory (records, rank 0's decisions, the data ring, the
  flag page's slots), its readers and writers, room to post, doorbells, and the constants every
  part shares;
* :mod:`sdp.engine.lane_decide`: who runs the lane (a waiting caller or the engine thread), rank
  0's decisions, consuming decided positions, and the hand-off to the engine;
* :mod:`sdp.engine.lane_reduce`: the reductions of positions decided FAST, and their scaling;
* :mod:`sdp.engine.lane_batch`: bursts gathered into batches, :meth:`Lane.burst` and the flushes;
* :mod:`sdp.engine.lane_now`: synchronous calls run whole in the caller
  (:meth:`Lane.allreduce_now`, :meth:`Lane.device_now`) and the compiled step's glue
  (:attr:`Lane.front`, :attr:`Lane.front_group`, learning).

The names other modules read here (``SPIN_S``, ``READ_BYTES``, ``NOW_READ_BYTES``, the flag
slots, ``signature`` and the compiled step's codes) are :mod:`sdp.engine.lane_ring`'s;
``ESCALATE_S`` is :mod:`sdp.engine.lane_decide`'s.
"""
import collections
import functools
import threading
import time
from typing import List, Optional

import numpy as np

from sdp.engine.coordinator import JOIN
from sdp.engine.handles import PartHandle
from sdp.engine.lane_batch import LaneBatching, _Batch
from sdp.engine.lane_decide import LaneDecisions
from sdp.engine.lane_now import LaneNow
from sdp.engine.lane_reduce import LaneReductions
from sdp.engine.lane_ring import (_BACKLOG, _BATCH_MAX, _REC, CLAIM, DATA_BYTES, DECIDED, DEPTH, GRACE_S, JOIN_SIG,
                                  JOINED, LATEST, OFF, PART_SIG, POSTED, READ_BYTES, SLOW, SPIN_S, LaneRing)
# (read here by sdp.engine.hostlink and the tests)
from sdp.engine.lane_ring import _NATIVE_DTYPES, _NATIVE_OPS, DONE, NOW_READ_BYTES, signature  # noqa: F401


class Lane(LaneNow, LaneBatching, LaneDecisions, LaneReductions, LaneRing):
    """The fast lane of one rank (see the module docstring).  ``mesh`` has shared segments and
    control rings with doorbells; ``to_engine(reqs)`` queues requests for the engine and
    ``wake_engine()`` wakes its thread (any thread); ``result_array(dtype, count)`` gives a new
    1-D result array; ``float_scale(req, dtype)`` and ``int_scale(buf, req)`` finish a reduction
    as the engine does (AVERAGE, postscale); ``spin_s``: how long :meth:`drive` polls, and only
    while the engine thread has no work (``engine``'s ``_pending`` and ``_queue`` empty; None:
    never).  ``device_reduce(req)``: the result of a device allreduce every rank posted alike
    (:meth:`device_now`).  ``front``: the compiled step's entry for :meth:`allreduce_now` (``front(name, a,
    op, postscale, out)``, see ``cc/lane_front.c``), or None; ``front_group``: its entry for a
    flattened group (``front_group(names, arrays, op, postscale, fusion threshold)``), or None."""

    def __init__(self, mesh, to_engine, wake_engine, result_array, float_scale, int_scale, timeout_s: float,
                 spin_s: float = SPIN_S, engine=None, request=None, device_reduce=None):
        seg, ctrl = mesh.shm, mesh.ctrl
        self.rank, self.size = mesh.rank, mesh.size
        self.page, self._ring_bell = ctrl.page, ctrl.ring
        self._to_engine, self._wake_engine = to_engine, wake_engine
        self._result_array, self._float_scale, self._int_scale = result_array, float_scale, int_scale
        self.timeout_s = timeout_s
        self.spin_s = spin_s  # (0 with more ranks than cores here: a polling caller takes a peer's core)
        self._engine = engine  # its _pending and _queue: the engine thread's work (drive polls only without)
        self._request = request  # the Request class (allreduce_now makes one only when it must)
        self._now = {}  # (name, dtype, shape, op, postscale) -> what allreduce_now keeps (_now_entry)
        self._typed = {}  # dtype -> every rank's data ring as that dtype (_typed_views)
        base = seg.lane_offset()
        self.rec = {q: memoryview(seg.at(q, base, np.int64, DEPTH * _REC)).cast("B").cast("q") for q in seg.peers}
        self.dec = memoryview(seg.at(0, base + DEPTH * _REC * 8, np.int64, DEPTH)).cast("B").cast("q")
        self._rec_np = {q: seg.at(q, base, np.int64, DEPTH * _REC).reshape(DEPTH, _REC) for q in seg.peers}  # (the
        # records again: a batch's are written at once, a burst's read at once)
        self._dec_np = seg.at(0, base + DEPTH * _REC * 8, np.int64, DEPTH)  # (the same decisions: for
        # a burst's slice assignment; ``dec`` is the faster one element at a time)
        self._parts = np.empty((_BATCH_MAX - 1, _REC), np.int64)  # (a batch's records after its first:
        self._parts[:, 0], self._parts[:, 2] = PART_SIG, np.arange(_BATCH_MAX - 1, 0, -1)  # the first position
        # goes in column 1 when posted, the positions left count down to 1)
        self.data = {q: seg.at(q, base + DEPTH * (_REC + 1) * 8, np.uint8, DATA_BYTES) for q in seg.peers}
        self.lock = threading.Lock()
        self.held = {}  # name -> Request this lane holds (posted eligible, not yet decided)
        self.off = False  # a join() was decided: everything goes to the engine until rearm()
        self._armed = 0  # the position from which the lane is on again (rearm(): decisions before it are old)
        self.enabled = True  # False: this rank posts nothing eligible (a timeline is being written)
        self.failed: Optional[BaseException] = None
        self._posted = 0
        self._done = 0  # positions this rank has consumed (its DONE)
        self._out = collections.deque()  # (position, Request) this lane holds, in order
        self._w = self._tail = 0  # data ring: bytes written, bytes freed (monotonic)
        self._extents = collections.deque()  # (position, data ring write count after its copy)
        self._awake = 0
        self._waiting = 0  # callers asleep on lane handles (drive() returned True)
        self._state = None  # what engine_turn() last saw (it runs the lane again when it changes)
        self._active_until = 0.0  # (monotonic) a caller runs the lane until then: the engine waits
        #: this rank's eligible requests the lane ran ("fast") or handed to the engine ("slow")
        self.counts = {"fast": 0, "slow": 0, "batches": 0}
        self._sigs = {}
        self._device_reduce = device_reduce  # (req) -> result of a device allreduce decided FAST (device_now)
        self._handoff: List = []  # requests for the engine, handed over once the lock is released
        self._deferred: List = []  # requests for the engine submitted while this lane held some
        self._batch: Optional[_Batch] = None  # a burst's small allreduces gathered, not yet posted
        self._batched = {}  # name -> its _Batch, gathered or held here
        self._batch_sigs = {}  # (every request's key) -> (signature, Layout) of a batch
        self._heads = set()  # names that last time came first in a burst: they start a batch
        self._head = None  # (name, handle) of the last submission's first request (to learn _heads)
        self._floor = 0  # positions every rank had consumed when last looked (_min_done)
        self._decided = 0  # rank 0
        self._closing = None  # rank 0: once a join() was seen, the positions complete then (later: OFF)
        self._first_seen = None  # rank 0: (position, when) of the first position left waiting
        module, self._ctx = self._native_step()  # the compiled step's Context (it keeps _alloc's state), or None
        self._native = None  # (p, sig, off, src, dst, red, scale, spin, decided, awake) -> (code, ring)
        self.front = self.front_group = None
        self.burst_front = self.burst  # (Runtime.burst: the compiled Lane.burst where there is one)
        if self._ctx is not None:
            self._native = functools.partial(module.now, self._ctx)
            self._ctx.attach(self, engine, PartHandle, _BATCH_MAX, READ_BYTES, GRACE_S, PART_SIG, SLOW, OFF)
            self.front, self.front_group, self.burst_front = self._ctx.front, self._ctx.front_group, self._ctx.burst

    def post(self, reqs) -> list:
        """Post ``reqs`` (one submission, in order); returns those the engine must run now (not
        eligible, another process set, the lane is off, or a burst).  Raises
        :class:`CollectiveTimeoutError` if a peer has not consumed a position for ``timeout_s``
        while this rank is :data:`DEPTH` positions ahead."""
        b = self._batch
        if b is not None and len(reqs) == 1 and not reqs[0].ps and b.takes(reqs[0], self.size):  # (a burst
            with self.lock:  # goes on: the common case, kept short)
                if self._batch is b and self.failed is None and not self.off:
                    self._head_to_learn()  # (the burst's first submission was one: it joins all the same)
                    self._batch_append(b, reqs[0])
                    return []
        engine, eligible = [], False
        page, rec = self.page[self.rank], self.rec[self.rank]
        latest = page[LATEST]
        with self.lock:
            if self.failed is not None:
                raise self.failed
            if self.page[0][DECIDED] - self._done >= _BACKLOG:
                self._progress()  # (positions only the engine ran, consumed in bulk: an OFF among them
                # turns the lane off; one at a time, a burst of 100 cost ~30 us more)
            burst = bool(self.held) or self._batch is not None or not self._engine_idle()  # (asynchronous
            # submissions: gathered into a batch, see _batch_add, or the engine's)
            self._head_to_learn()
            for req in reqs:
                if req.ps or self.off:
                    engine.append(req)
                    continue
                if req.name == JOIN:
                    sig = JOIN_SIG
                elif burst or req.name in self._heads:  # (a burst, or learnt: a burst follows it)
                    if not burst:
                        self._head = (req.name, req.handle)
                    burst = True
                    if self._batch_add(req):  # (one position for the burst's small allreduces)
                        continue
                    sig = 0  # (else the engine's; a duplicate name there is reported)
                else:
                    sig = self._signature(req)
                    if sig > 0:
                        self._head = (req.name, req.handle)
                if self._batch is not None:  # (what follows a batch is posted after it)
                    eligible = self._flush_batch() or eligible
                if self._full(self._posted):
                    self._wait_room()
                p = self._posted  # (after the wait: another thread may post while it lets the lock go)
                off = nbytes = 0
                if sig > 0 and (req.kind == "allreduce" or req.root == self.rank):  # (a broadcast: the root's)
                    nbytes = req.array.nbytes
                    off = self._alloc(nbytes, p)
                    if off is None:
                        sig = nbytes = off = 0
                    else:
                        req.pack_into(self.data[self.rank][off:off + nbytes].view(req.array.dtype))
                i = (p % DEPTH) * _REC
                rec[i], rec[i + 1], rec[i + 2] = sig, off, nbytes
                self._posted = p + 1
                if sig > 0 or sig == JOIN_SIG:  # (rank 0 decides what a rank waits on at once, bursts
                    page[LATEST] = p + 1  # lazily; before the count: never a post it sees without it)
                page[POSTED] = p + 1  # last: the record is visible before its count
                if sig == JOIN_SIG:  # (this rank posts nothing more; rank 0 turns the others off)
                    page[JOINED] = p + 1
                    self.off = True
                if sig <= 0:
                    self._to_engine_after_held(req, engine)
                    continue
                eligible = burst = True  # (what follows in this submission is a burst)
                self.held[req.name] = req
                req.handle._lane = self
                self._out.append((p, req))
            if eligible:
                self._active_until = time.monotonic() + GRACE_S  # (the caller usually waits next)
            if self.held:
                if self.rank == 0:
                    self._decide()
                if self.page[0][DECIDED] > self._out[0][0]:
                    self._progress()  # (a request decided SLOW goes to the engine before what follows it)
            if self._handoff:
                engine = self._take_handoff() + engine
        if self.rank != 0 and page[LATEST] != latest:  # (something rank 0 decides at once was posted)
            self._ring_sleepers()
        return engine

    def rearm(self, vote) -> bool:
        """After a ``join()`` completed (every rank posted its join, its last post: every rank's
        lane is off), turn the lane on again at one position on every rank.  ``vote(ok)`` is an
        allreduce MIN of ``ok`` (0 or 1) by every rank through the engine (a barrier).

        1. Every rank pads its records with 0s up to the furthest rank's count ``B`` (the same
           on every rank: no count moves after a join), clears its ``JOINED``, and votes.
        2. Every rank runs the lane until rank 0 has decided, and every rank consumed, every
           position below ``B``; rank 0 then forgets the join (its claim drops to ``B``).  Votes.
        3. On a unanimous vote every rank's next post is position ``B``, lane on; else the lane
           stays off on every rank (an off lane on some ranks only would wait
           :data:`ESCALATE_S` on every position they do not post).

        Returns whether the lane is on again.  Raises what the vote's allreduce raises."""
        with self.lock:
            ok = self.off and self.failed is None and not (self.held or self._deferred or self._batch)
            if ok:
                page, rec = self.page[self.rank], self.rec[self.rank]
                end = max(self.page[q][POSTED] for q in range(self.size))
                while self._posted < end:
                    if self._full(self._posted):
                        self._wait_room()
                    i = (self._posted % DEPTH) * _REC
                    rec[i] = rec[i + 1] = rec[i + 2] = 0
                    self._posted += 1
                page[POSTED] = end  # (the records before their count)
                page[JOINED] = 0
        if not vote(int(ok)):
            return False
        deadline = time.monotonic() + self.timeout_s
        with self.lock:
            while ok and not (self.page[0][DECIDED] >= end and self._min_done() >= end):
                self._progress()
                if self.failed is not None or time.monotonic() > deadline:
                    ok = False
                    break
                self._nap()
            if ok and self.rank == 0:
                self._closing = self._first_seen = None
                self.page[0][CLAIM] = end
            engine = self._take_handoff()  # (none: this rank held no request)
        if engine:
            self._to_engine(engine)
        if not vote(int(ok)):
            return False
        with self.lock:
            self.off, self._armed = False, end
        return True

    def fail_all(self, err: BaseException) -> None:
        """Fail every request the lane holds with ``err``; later posts raise it."""
        with self.lock:
            self.failed = err
            held, self.held = list(self.held.values()) + self._deferred, {}
            if self._batch is not None:
                held.append(self._batch)
            self._deferred, self._batch = [], None
            self._batched.clear()
        for req in held:
            if type(req) is _Batch:
                req.fail(err)
            else:
                req.handle._lane = None
                req.handle._set(error=err)
