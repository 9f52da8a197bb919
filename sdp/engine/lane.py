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
goes to the engine at once.  A **burst** (asynchronous submissions: everything a rank submits
while its engine thread has work, the lane holds a request of it or a batch is being gathered,
and what follows a name that came first in a burst the last time it was submitted, learnt per
rank and name) is not posted request by request: its small allreduces are gathered into a
**batch** (:class:`_Batch`: one dtype, op and postscale) posted at once when a caller waits on
or polls one of them, when a request that cannot join comes, or by the engine thread
:data:`GRACE_S` after the last submission: one position per request, the first with the batch's
signature and one packed copy, the others :data:`PART_SIG`; the rest of a burst goes to the
engine (which batches it: one negotiation, fused buckets).  While the lane holds a request, what
goes to the engine waits until that request is decided (waiting on it runs the lane), so a
request decided SLOW reaches the engine before what was submitted after it and is batched with it.

**Rank 0 decides** each position, in order, alone (so every rank sees one outcome):

* FAST when every rank posted it with the same non-zero signature: the same collective
  everywhere.  Every rank then reduces the posted copies itself, in rank order (the same
  operations on every rank, so results are bit-identical), into a new array (a broadcast:
  copies the root's): no barrier, no message, no engine.
* SLOW as soon as one record is 0 or two differ (another collective, another order, a
  mismatch), as soon as a rank posted requests for the engine after its last lane request
  (they would wait on this one), or when a position waited :data:`ESCALATE_S` for a rank that has not posted it
  (a rank busy elsewhere, or waiting for something that needs this decision first): an eligible
  request then goes to the engine like any other, which negotiates, reports mismatches and
  stalls on every rank as before.  A SLOW decision costs speed, never correctness.
* OFF once any rank posted ``join()``: the lane stays off for the rest of the job (a joined rank
  posts nothing more, so positions could never fill).

A position every rank posted is decided by its records alone (OFF with a join's, SLOW with a 0
or two that differ, else FAST), so a rank that sees every record of its held request equal
**consumes it FAST without waiting for rank 0** (:meth:`Lane._fast_before_rank0`), unless rank 0
has *claimed* the position (``CLAIM``): before any other decision (on time, on what was posted
after it, after a join) rank 0 stores the claim, fences, and reads the posts again, deciding by
the records what is complete by then (Dekker's pattern again: a rank reads the records, then the
claim; so either it sees the claim or rank 0 sees the records it saw; see the doorbells below).

A **synchronous allreduce** (``sdp.allreduce``) runs whole in its caller while the lane is idle
(:meth:`Lane.allreduce_now`): posted, polled for and reduced into its result without a
:class:`Request` or a handle; what is not consumed while it polls becomes a held request.
A synchronous allreduce of **device memory** (:meth:`Lane.device_now`) is posted the same way
with a record that carries no data: its caller first packs its input where every peer reads it
(:mod:`sdp.engine.device_path`'s lane windows), and once every rank posted the same signature each
reduces every rank's copy there.
Where :mod:`sdp.engine.native` builds, its common case (post, poll, reduce) is one compiled call
(``cc/lane_now.c``) that hands everything else back to this code; ``sdp.allreduce`` calls its
entry (:attr:`Lane.front`) first, which runs a learnt name's call whole, checks, allocation and
result included, and goes on in :meth:`Lane._finish_now` where the common case ends;
``sdp.grouped_allreduce`` calls :attr:`Lane.front_group` the same way for a learnt group
(:meth:`Lane.learn_group`), packing included, and :meth:`Lane.flush` the compiled flush for a
learnt batch (:meth:`Lane._learn_batch`): its positions posted, polled for and reduced in one call.

Who runs the lane: the caller waiting on a lane handle (:meth:`drive`: it polls for up to
:data:`SPIN_S` seconds, yielding the core between polls, then sleeps on the handle; it does not
poll when this host has fewer cores than local ranks, as for the engine's spin, nor while the
engine thread has work), else the engine thread, which a **doorbell** wakes
(:meth:`shm_ctrl.ControlRings.ring`) only where needed, since ringing costs the ringer its core for up
to ~0.7 ms when the woken thread takes it: a post rings rank 0 (and a rank that posted as far),
and a decision the ranks that posted it, only if a caller of theirs sleeps on a lane handle
(``WAITING``); a caller that stops
polling rings rank 0 if its position is undecided; a rank waiting for room rings the laggards.
No doorbell while the target's ``AWAKE`` flag says a caller polls or ``RUNG`` says it was rung
and has not looked yet (Dekker's pattern: flag or count stored, then a full fence, a locked
instruction, then the other side read, so one side always sees the other).

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
import collections
import functools
import hashlib
import logging
import os
import threading
import time
from typing import List, Optional

import numpy as np

from sdp.common import errors
from sdp.common.reduce_ops import UFUNCS, ReduceOp, accumulation_dtype
from sdp.engine import collectives, fusion
from sdp.engine.coordinator import JOIN
from sdp.engine.handles import Handle, PartHandle
from sdp.transport.shm_ctrl import LANE_BYTES

log = logging.getLogger("sdp.engine")

DEPTH = 256  # positions a rank may run ahead of the slowest rank's consumption
_REC = 3  # int64 per record: signature, data offset, bytes
DATA_BYTES = LANE_BYTES - DEPTH * 8 * (_REC + 1)  # each rank's data ring (records, decisions before)
READ_BYTES = 512 << 10  # eligible: bytes x (size - 1) at most this (every rank reads every copy)
NOW_READ_BYTES = 1 << 20  # the same for a synchronous allreduce (allreduce_now)
ESCALATE_S = 0.005  # seconds a position waits for a rank that has not posted it, then SLOW
SPIN_S = 200e-6  # seconds a waiting caller polls the lane before it sleeps on the handle
GRACE_S = 200e-6  # seconds after a post during which the engine thread leaves the lane to the caller
POSTED, DONE, DECIDED, AWAKE, RUNG, WAITING, LATEST, JOINED, CLAIM = range(8, 17)  # int64 slots of the flag page
FAST, SLOW, OFF = 1, 2, 3  # decisions
JOIN_SIG = -1  # the signature of a join() record
PART_SIG = -2  # the record of a batch's request after its first (decided SLOW, and ignored)
_BATCH_MAX = DEPTH // 2  # requests in one batch
_TICK_S = 0.001  # the engine thread's shortest sleep (a poll's timeout is whole milliseconds; never spin:
# a spinning engine thread holds the GIL the caller needs back after every numpy call)
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


class Lane:
    """The fast lane of one rank (see the module docstring).  ``mesh`` has shared segments and
    control rings with doorbells; ``to_engine(reqs)`` queues requests for the engine and
    ``wake_engine()`` wakes its thread (any thread); ``result_array(dtype, count)`` gives a new
    1-D result array; ``float_scale(req, dtype)`` and ``int_scale(buf, req)`` finish a reduction
    as the engine does (AVERAGE, postscale); ``spin_s``: how long :meth:`drive` polls, and only
    while the engine thread has no work (``engine``'s ``_pending`` and ``_queue`` empty; None:
    never).  ``device_reduce(req)``: the result of a device allreduce every rank posted alike
    (:meth:`device_now`).  ``front``: the compiled step's entry for :meth:`allreduce_now` (``front(name, a,
    op, postscale, out)``, see ``cc/lane_now.c``), or None; ``front_group``: its entry for a
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
        self.off = False  # a join() was decided: everything goes to the engine from now on
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

    # -- caller side ----------------------------------------------------------------------------
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

    def burst(self, name: str, a, op, postscale: float):
        """:meth:`post`'s common case for ``sdp.allreduce_async``, without a :class:`Request` or
        a :class:`Handle` of its own: the allreduce of ``a`` (a numpy array) joins the batch being
        gathered if :meth:`_Batch.takes` it (and ``a`` is C-contiguous, ``postscale`` a float);
        returns a :class:`PartHandle` of the batch's handle, or None (nothing done: submit it
        as usual).  (A Request and a Handle each cost ~0.7 us of a burst's ~2.5 us per call.)
        :attr:`burst_front` is this, compiled (``cc/lane_now.c``) where the extension is loaded."""
        if (self._batch is None or type(postscale) is not float or type(name) is not str
                or type(a) is not np.ndarray or not a.flags.c_contiguous):
            return None
        with self.lock:
            b = self._batch
            if (b is None or self.failed is not None or self.off
                    or not b.fits(name, a, op, postscale, self.size)):  # (under the lock: two threads never
                return None  # both take a batch's last room, or one name)
            self._head_to_learn()  # (as post)
            self._active_until = time.monotonic() + GRACE_S  # (as _batch_append)
            return b.add_part(name, a)

    def _ring_sleepers(self) -> None:
        """After a post of something rank 0 decides at once (not rank 0's): ring a rank whose
        caller sleeps on a lane handle if it is rank 0 (it decides) or it posted as far (it may
        consume at once); the others run the lane when they post or wait."""
        _fence()
        for q in range(self.size):
            if q != self.rank and self.page[q][WAITING] and (q == 0 or self.page[q][POSTED] >= self._posted):
                self._ring(q)

    def _engine_idle(self) -> bool:
        """Whether the engine thread has no work (then a waiting caller polls)."""
        engine = self._engine
        return engine is None or not (engine._pending or engine._queue)

    def _native_step(self):
        """``(extension, Context)`` of the compiled step (:mod:`sdp.engine.native`) on this lane's
        memory, or ``(None, None)`` (no extension, or this rank cannot map a peer's region writable)."""
        from sdp.engine import native  # (here: ``python -m sdp.engine.native`` runs it as __main__)
        module = native.load()
        if module is None:
            return None, None
        ranks = range(self.size)
        try:
            ctx = module.Context(self.rank, self.size, [self.page[q] for q in ranks], [self.rec[q] for q in ranks],
                                 self.dec, [self.data[q] for q in ranks], (DEPTH, _REC, DATA_BYTES),
                                 (POSTED, DONE, DECIDED, AWAKE, RUNG, WAITING, LATEST, CLAIM), FAST)
        except (ValueError, TypeError, BufferError) as e:
            log.debug("sdp: the fast lane runs in Python (%s)", e)
            return None, None
        return module, ctx

    def _after_native(self, ring: int) -> None:
        """After the compiled step: ring the ranks of ``ring``'s bits (it fenced after the stores
        they must see); rank 0's bit 0: posts wait for a decision."""
        for q in range(self.size):
            if ring >> q & 1 and q != self.rank:
                self._ring(q)
        if self.rank == 0 and ring & 1:
            self._decide()

    def allreduce_now(self, name: str, a, op, postscale: float, out: Optional[np.ndarray], layout=None,
                      hold: bool = False):
        """A synchronous allreduce of every rank, run whole in the calling thread while the lane
        is idle (nothing held, gathered or deferred for the engine here): posted as :meth:`post`
        posts it, then polled for as :meth:`drive` polls and, when every rank posted the same
        signature (consumed without rank 0, or rank 0's decision), reduced into ``out`` or a new
        array; no :class:`Request` or handle is made.  ``a``: a C-contiguous numpy array, or,
        with ``layout`` (a flattened group's :class:`fusion.Layout`, see :meth:`Request.group`),
        the list of the group's arrays, packed straight into the data ring (``out`` None);
        ``postscale``: a float.  Returns the result (``a``'s shape and dtype; a group: the list
        of its arrays' results, views of one array), or None when the lane does not take it now
        (nothing posted: the caller submits it as usual).  If it is not consumed while the
        caller polls (a rank late, or decided SLOW), it becomes a held request, waited on as
        any other (``hold``: its handle is returned instead, for an asynchronous caller).  Raises
        what :class:`Request` raises for bad input, and the lane's failure.
        (:attr:`front`, the compiled step's entry, runs the common case of this whole and calls
        :meth:`_finish_now` for the rest.)"""
        known = self._known(name, a, op, postscale, layout)
        sig, native = known[0], known[7]
        if native is not None and layout is None and not known[5] and self.enabled:  # (the compiled entry
            self._ctx.learn(name, a.dtype, a.shape, op, postscale, sig, *native)  # runs its next call whole)
        if layout is not None:
            dtype, n = layout.dtype, layout.count
        elif not a.flags.c_contiguous or out is not None and (
                type(out) is not np.ndarray or out.shape != a.shape or out.dtype != a.dtype
                or not out.flags.c_contiguous or not out.flags.writeable):
            return None
        else:
            dtype, n = a.dtype, a.size
        if not sig or not self.lock.acquire(blocking=False):
            return None
        p = self._posted
        try:
            off = self._room_now(name, n * dtype.itemsize, p)
            if off is not None:
                if layout is not None:  # (packed straight into the data ring)
                    at = off // dtype.itemsize
                    layout.pack(a, (self._typed.get(dtype) or self._typed_views(dtype))[self.rank][at:at + n])
                result, ring = None, 0
                if native is not None:  # (post, poll and reduce in one call)
                    result = self._result_array(dtype, n) if out is None else out
                    self._active_until = float("inf")
                    try:
                        verdict, ring = self._native(p, sig, off, a if layout is None else (a, layout.starts), result,
                                                     native[0], native[1],
                                                     self.spin_s if self._engine_idle() else 0.0,
                                                     self._decided, self._awake)
                    finally:
                        self._active_until = 0.0
                    self._posted = p + 1  # (it raises before it posts: bad buffers)
                    if self.rank == 0 and verdict in (FAST, _NATIVE_RECORD):  # (it decided p, as _publish)
                        self._decided, self._first_seen = p + 1, None
                else:
                    if layout is None:
                        at = off // dtype.itemsize
                        np.copyto((self._typed.get(dtype) or self._typed_views(dtype))[self.rank][at:at + n],
                                  a if a.ndim == 1 else a.reshape(-1))
                    i, mine, rec = (p % DEPTH) * _REC, self.page[self.rank], self.rec[self.rank]
                    rec[i], rec[i + 1], rec[i + 2] = sig, off, n * dtype.itemsize
                    self._posted = p + 1
                    mine[LATEST] = p + 1
                    mine[POSTED] = p + 1  # last: the record is visible before its count
                    if self.rank != 0:
                        self._ring_sleepers()
                    verdict = _NATIVE_PYTHON  # (polled below)
        except BaseException:
            self.lock.release()
            raise
        if off is None:
            self.lock.release()
            return None
        return self._finish_now(p, verdict, ring, result, name, a, op, postscale, out, layout, known, hold)

    def learn_group(self, names, threshold: int, metas: list, group: str, layout, op, postscale: float) -> None:
        """After :meth:`allreduce_now` ran flattened group ``group`` (``layout``: ``sdp.api``'s plan
        of ``names`` at fusion ``threshold`` for arrays of ``metas``, a list of (dtype, shape)):
        :attr:`front_group` (the compiled entry, ``Context.front_group``) runs the group's next
        calls whole, as :meth:`allreduce_now` teaches :attr:`front` a single array's.  Not where
        Python must finish the call (integers scaled) or a timeline is written."""
        known = self._now.get((group, id(layout), op, postscale))
        if (self._ctx is None or known is None or not known[0] or known[5] or known[6] is not layout
                or known[7] is None or not self.enabled):
            return
        try:
            self._ctx.learn_group(tuple(names), threshold, metas, group, layout, layout.starts, layout.spans,
                                  layout.count, layout.dtype, op, postscale, known[0], *known[7])
        except (TypeError, ValueError):  # (names that are not strings, a threshold not an int: not learnt,
            pass  # the call done in Python all the same)

    def _known(self, name, a, op, postscale, layout) -> tuple:
        """What :meth:`allreduce_now` keeps for these arguments (:meth:`_now_entry`)."""
        key = (name, a.dtype, a.shape, op, postscale) if layout is None else (name, id(layout), op, postscale)
        known = self._now.get(key)
        if known is None or known[6] is not layout:
            known = self._now_entry(key, name, a, op, postscale, layout)
        return known

    def _room_now(self, name: str, nbytes: int, p: int) -> Optional[int]:
        """(Lock held.) Where :meth:`allreduce_now` copies position ``p`` in the data ring, or
        None when the lane is not idle (the call then goes to the engine as usual)."""
        return self._alloc(nbytes, p) if self._idle_now(name, p) else None

    def _idle_now(self, name: str, p: int) -> bool:
        """(Lock held.) Whether a synchronous call may post position ``p`` now: nothing held,
        gathered or deferred here, room, and ``name`` not learnt as a burst's head."""
        if (self.failed is not None or self.off or not self.enabled or self.held or self._batch is not None
                or self._deferred or self.page[0][DECIDED] - self._done >= _BACKLOG or self._full(p)):
            return False  # (a busy engine thread is no reason: a call waited at once is no burst; it
            # only does not poll then, see _poll_now)
        self._head_to_learn()
        return name not in self._heads  # (learnt: a burst follows it, see post)

    def _finish_now(self, p: int, verdict: int, ring: int, result, name, a, op, postscale, out, layout=None,
                    known=None, hold: bool = False):
        """The rest of :meth:`allreduce_now` once position ``p`` is posted (the lock held: it
        is released here): ring the ranks of ``ring`` (:meth:`_after_native`), poll when the
        compiled step answered :data:`_NATIVE_PYTHON` (the Python post answers it too), reduce
        unless the compiled step did (``result``: its result array, or None), else hold the
        request for the engine and wait on it (``hold``: return its handle).  ``known``:
        :meth:`_known`'s entry, or None."""
        try:
            if ring:
                self._after_native(ring)
            reduced = verdict == FAST
            if verdict == _NATIVE_PYTHON:
                verdict = self._poll_now(p)
            elif verdict == _NATIVE_RECORD:  # (consumed FAST: _copies below raises)
                verdict = FAST
            if verdict == FAST:
                if known is None:
                    known = self._known(name, a, op, postscale, layout)
                _, scaling, ufunc, acc, fscale, ints = known[:6]
                dtype, n = (a.dtype, a.size) if layout is None else (layout.dtype, layout.count)
                if result is None:
                    result = self._result_array(dtype, n) if out is None else out
                try:
                    if not reduced:
                        collectives.reduce_copies(ufunc, self._copies(p, name, dtype, n), result.reshape(-1), acc,
                                                  fscale)
                    if ints:
                        self._int_scale(result, scaling)
                finally:
                    self._done = p + 1
                    self.page[self.rank][DONE] = p + 1  # (after the reduction read the peers' copies)
                self.counts["fast"] += 1
                if layout is not None:
                    return layout.views(result)
                return result if out is not None else result.reshape(a.shape)
            req = self._make_request(name, a, op, postscale, out, layout)
            engine = self._hold(p, req)
        finally:
            self.lock.release()
        return self._wait_held(req, engine, hold)

    def _hold(self, p: int, req) -> list:
        """(Lock held.)  Position ``p``, ``req``'s, was not consumed while its caller polled (a
        rank late) or was decided SLOW or OFF: the lane holds ``req`` as a posted request (a later
        FAST decision runs it wherever the lane runs; SLOW sends it to the engine).  Returns the
        requests to hand the engine once the lock is let go (:meth:`_wait_held`)."""
        req.handle._lane = self
        self.held[req.name] = req
        self._out.append((p, req))
        self._progress()  # (decided SLOW or OFF: to the engine)
        return self._take_handoff()

    def _wait_held(self, req, engine: list, hold: bool = False):
        """(Lock let go.)  Hand ``engine`` (:meth:`_hold`'s) over, then wait for held ``req``'s result
        (``hold``: return its handle instead)."""
        if engine:
            self._to_engine(engine)
        return req.handle if hold else req.handle.wait(_spin=False)

    def device_now(self, req, pack):
        """A synchronous allreduce of device memory (``req``: a :class:`Request` of every rank, no
        prescale, of a :class:`~sdp.engine.device_arrays.DeviceTensor` or group), run in the
        calling thread while the lane is idle and the engine thread has no work: ``pack()`` puts
        this rank's input where every peer reads it (the device path's lane window) and returns
        False if it cannot now; then a record without data is posted and polled for as
        :meth:`allreduce_now` does; once every rank posted the same signature, the lane's
        ``device_reduce(req)`` gives the result (every rank reads every window;
        :mod:`sdp.engine.device_path`).  Not consumed while polling (a rank late, or SLOW): held
        like any posted request (a later FAST decision calls ``device_reduce`` in whichever thread
        runs the lane).  Returns the result, or None
        with nothing posted (the caller submits ``req`` to the engine)."""
        sig = self._sig(req.key()) if self.enabled else 0
        if not sig or not self.lock.acquire(blocking=False):
            return None
        p = self._posted
        try:
            if not (self._idle_now(req.name, p) and self._engine_idle() and pack()):
                return None
            i, mine, rec = (p % DEPTH) * _REC, self.page[self.rank], self.rec[self.rank]
            rec[i], rec[i + 1], rec[i + 2] = sig, 0, 0
            self._posted = p + 1
            mine[LATEST] = p + 1
            mine[POSTED] = p + 1  # last: the record is visible before its count
            if self.rank != 0:
                self._ring_sleepers()
            if self._poll_now(p) == FAST:
                try:
                    return self._device_reduce(req)
                finally:
                    self._done = p + 1
                    self.page[self.rank][DONE] = p + 1  # (after the reduction read the peers' windows)
                    self.counts["fast"] += 1
            engine = self._hold(p, req)
        finally:
            self.lock.release()
        return self._wait_held(req, engine)

    def _now_entry(self, key, name, a, op, postscale, layout) -> tuple:
        """What :meth:`allreduce_now` keeps per key: (signature or 0, the op and postscale for
        integer scaling, ufunc, accumulation dtype, float scale, whether integers are scaled,
        ``layout``, and for the compiled step (:mod:`sdp.engine.native`) its reduction code and
        float scale, or None where it does not reduce: another dtype, or no extension)."""
        req = self._make_request(name, a, op, postscale, None, layout)  # (bad input raises)
        dtype = req.array.dtype
        sig = self._signature(req, NOW_READ_BYTES)  # (0 unless the lane can reduce it: _reducible)
        fscale = self._float_scale(req, dtype)
        red = _NATIVE_DTYPES.get(dtype.str) if self._native is not None and sig else None
        entry = (sig, _Scaling(op, req.postscale), UFUNCS.get(op), accumulation_dtype(dtype), fscale,
                 dtype.kind in "iub" and (op == ReduceOp.AVERAGE or postscale != 1.0), layout,
                 None if red is None else (red * 4 + _NATIVE_OPS[op], 1.0 if fscale is None else float(fscale)))
        if self.enabled:  # (a timeline being written: not remembered)
            if len(self._now) >= _SIGS_MAX:
                self._now.clear()
                if self._ctx is not None:
                    self._ctx.forget()
            self._now[key] = entry
        return entry

    def _make_request(self, name, a, op, postscale, out, layout):
        """The :class:`Request` of :meth:`allreduce_now`'s arguments (a flattened group's with ``layout``)."""
        if layout is None:
            return self._request(name, "allreduce", a, op, None, 1.0, postscale, None, out, 0)
        return self._request.group(name, a, layout, op=op, postscale=postscale)

    def _poll_now(self, p: int) -> int:
        """Poll for position ``p``'s outcome (as :meth:`drive` polls, inside the lock): FAST,
        SLOW or OFF, or 0 when :data:`SPIN_S` passed first.  Once every rank posted ``p``: rank 0
        decides it (at once when every record equals this rank's and everything before it is
        decided, else by :meth:`_decide`), the others consume it as :meth:`_fast_before_rank0`."""
        n, page, mine, first = self.size, self.page, self.page[self.rank], self.page[0]
        end = time.perf_counter() + (self.spin_s if self._engine_idle() else 0.0)
        mine[AWAKE] = self._awake + 1
        self._active_until = float("inf")
        verdict = 0
        try:
            while True:
                if self.rank:
                    if self._fast_before_rank0(p):
                        verdict = FAST
                        break
                elif self._decided == p and self._equal(p):  # (what _decide would decide, without its work)
                    self.dec[p % DEPTH] = FAST
                    self._publish(p + 1, range(1, n))
                    verdict = FAST
                    break
                elif min(page[q][POSTED] for q in range(n)) > p:
                    self._decide()
                if first[DECIDED] > p:
                    verdict = self.dec[p % DEPTH]
                    break
                if time.perf_counter() >= end:
                    break
                os.sched_yield()
        finally:
            self._active_until = 0.0
            mine[AWAKE] = self._awake
            mine[RUNG] = 0
            if self.rank == 0:  # (as drive: a peer's doorbell skipped while we polled is not lost)
                _fence()
                self._decide()
        return verdict

    def _to_engine_after_held(self, req, engine: list) -> None:
        """``req`` goes to the engine: now (into ``engine``) if this lane holds nothing, else
        after what it holds is decided (a request decided SLOW reaches the engine before what
        was submitted after it, so the engine batches them together; waiting on ``req`` meanwhile
        runs the lane)."""
        if self.held:
            req.handle._lane = self
            self._deferred.append(req)
        else:
            engine.append(req)

    def _head_to_learn(self) -> bool:
        """Learn whether the last first-of-a-submission was a burst's (False: nothing to learn)."""
        if self._head is None:
            return False
        name, handle = self._head
        self._head = None
        if handle._waited:  # (waited on before this submission: not a burst)
            self._heads.discard(name)
        elif len(self._heads) < _SIGS_MAX:
            self._heads.add(name)
        return True

    def _batch_append(self, b, req) -> None:
        req.handle._lane = self
        self._active_until = time.monotonic() + GRACE_S  # (the engine thread leaves the batch to us)
        b.add(req)

    def _batch_add(self, req) -> bool:
        """Add ``req``, submitted in a burst, to the batch being gathered if it can go there (a
        small allreduce of a host array the lane could run, of the batch's dtype, op and
        postscale, a name not held here; a batch that it would make too big for the data ring's
        reads, or of another dtype, op or postscale, is posted first).  False: not batchable."""
        if not self._reducible(req) or req.layout is not None or req.name in self.held or req.name in self._batched:
            return False
        b = self._batch
        if b is not None and b.takes(req, self.size):
            self._batch_append(b, req)
            return True
        if b is not None:
            self._flush_batch()  # (then a new batch)
        self._batch = _Batch(req, self._batched, self)
        self._batch_append(self._batch, req)
        return True

    def _flush_batch(self) -> bool:
        """Post the batch being gathered (inside the lock): one position per request, as if
        posted one by one, so that positions stay aligned across ranks whatever each gathered;
        the first carries the batch's signature (over every request's :meth:`Request.key`) and
        its copy (one packed buffer, :class:`Layout`), the others mark themselves part of it
        (:data:`PART_SIG`, the first position, how many positions are left).  Rank 0 decides
        the first position as any other; it decides for the whole batch.  Returns whether it
        was posted for the lane (else its requests go to the engine: the data ring was full)."""
        b, self._batch = self._batch, None
        m = len(b.arrays)
        if self._full(self._posted + m - 1):
            self._wait_room(m - 1)
        p = self._posted
        keys = (b.dtype, b.op, b.postscale, tuple(b.order), tuple(a.shape for a in b.arrays))  # (what
        # Request.key() adds is the same for all)
        known = self._batch_sigs.get(keys)
        if known is None:
            if len(self._batch_sigs) >= _SIGS_MAX:
                self._batch_sigs.clear()
            digest = hashlib.blake2b(repr(("batch", keys)).encode(), digest_size=8).digest()
            known = self._batch_sigs[keys] = ((int.from_bytes(digest, "little") >> 2) | 1,
                                               fusion.Layout(b.arrays))
        sig, b.layout = known
        self._learn_batch(b, sig, b.layout)
        nbytes = b.layout.count * b.dtype.itemsize
        off = self._alloc(nbytes, p)
        if off is None:
            sig = nbytes = off = 0
        else:
            b.layout.pack(b.arrays, self.data[self.rank][off:off + nbytes].view(b.dtype))
        i, page, rec = (p % DEPTH) * _REC, self.page[self.rank], self.rec[self.rank]
        rec[i], rec[i + 1], rec[i + 2] = sig, off, nbytes
        if m > 1:  # (positions p + 1 .. p + m - 1: the template's last m - 1 rows, where the ring wraps in two)
            parts = self._parts[_BATCH_MAX - m:]
            parts[:, 1] = p
            if not sig:
                parts = parts.copy()
                parts[:, 0] = 0
            mine, at = self._rec_np[self.rank], (p + 1) % DEPTH
            k = min(m - 1, DEPTH - at)
            mine[at:at + k] = parts[:k]
            if k < m - 1:
                mine[:m - 1 - k] = parts[k:]
        self._posted = p + m
        if sig:
            page[LATEST] = p + m  # (before the count, as in post)
        page[POSTED] = p + m  # last: the records are visible before their count
        if not sig:
            self._handoff += b.to_engine(self._request)
            return False
        self.held[b.name] = b
        self._out.append((p, b))
        self._active_until = time.monotonic() + GRACE_S
        return True

    def flush(self, engine_thread: bool = False, spin: bool = False) -> None:
        """Post the batch being gathered, if any (a caller waits for one of its requests, or,
        ``engine_thread``, nobody did within :data:`GRACE_S` of the last submission); ring rank 0
        if it sleeps.  A caller's flush of a learnt batch (:meth:`_learn_batch`) while nothing else
        is held here is the compiled ``Context.flush`` where there is one: posted, polled for
        (``spin``: up to :attr:`spin_s`, as :meth:`drive` polls) and reduced in one call, as
        ``sdp.grouped_allreduce`` runs a learnt group (:attr:`front_group`); what it does not
        consume goes on in :meth:`_finish_batch`."""
        b = self._batch
        if b is None or not engine_thread and self._ctx is not None and self._ctx.flush(b, spin) is not None:
            return
        with self.lock:
            b = self._batch
            posted = (b is not None and not (engine_thread and (time.monotonic() < self._active_until or self._full(
                self._posted + len(b.arrays) - 1))) and self._flush_batch())  # (the engine thread never waits
            # for room: the positions it waits for may need a collective of its own first)
            engine = self._take_handoff()
        if engine:
            self._to_engine(engine)
        if posted and self.rank != 0:
            _fence()
            if self.page[0][WAITING]:
                self._ring(0)

    def _finish_batch(self, p: int, verdict: int, ring: int, b, layout) -> bool:
        """The rest of the compiled flush (``Context.flush``; the lock held, released here) once
        batch ``b`` (``layout``: its :class:`fusion.Layout`) was posted at ``p`` and not consumed
        FAST without a doorbell (``verdict``: as :meth:`_finish_now`'s): the lane holds it as
        :meth:`_flush_batch` leaves it, rings ``ring``'s ranks (:meth:`_after_native`) and runs
        once (FAST: reduced here again; SLOW: to the engine).  Returns True."""
        try:
            b.layout = layout
            self.held[b.name] = b
            self._out.append((p, b))
            self._active_until = time.monotonic() + GRACE_S
            if ring:
                self._after_native(ring)
        except BaseException:
            self.lock.release()
            raise
        self._progress_and_release()
        return True

    def _learn_batch(self, b, sig: int, layout) -> None:
        """Teach the compiled flush (``Context.learn_batch``) batch ``b``'s names, dtypes, shapes,
        op and postscale, signature ``sig`` and ``layout`` unless it knows them (one batch per first
        name: the last posted in Python): its next flush by a caller runs whole (:meth:`flush`).
        Not where Python must finish the reduction (integers scaled, a dtype the compiled step
        does not reduce) or a timeline is written."""
        red = _NATIVE_DTYPES.get(b.dtype.str)
        if (self._ctx is None or red is None or b.op not in _NATIVE_OPS or len(b.arrays) < 2 or not self.enabled
                or b.dtype.kind in "iub" and (b.op == ReduceOp.AVERAGE or b.postscale != 1.0)
                or self._ctx.batch_sig(b.order[0]) == sig):  # (learnt already: the common case)
            return
        fscale = self._float_scale(b, b.dtype)
        try:
            self._ctx.learn_batch(tuple(b.order), 0, [(a.dtype, a.shape) for a in b.arrays],
                                  b.name, layout, layout.starts, layout.spans, layout.count, b.dtype, b.op,
                                  b.postscale, sig, red * 4 + _NATIVE_OPS[b.op],
                                  1.0 if fscale is None else float(fscale))
        except (TypeError, ValueError):  # (names that are not strings: not learnt)
            pass

    def drive(self, handle, spin: bool = True) -> bool:
        """Run the lane from a caller waiting on ``handle`` (held by this lane) for up to
        :data:`SPIN_S` seconds, yielding the core between polls; it returns when the handle is
        done or handed to the engine, or the time is up (the engine thread takes over).  Returns
        True when the caller is to sleep on the handle, counted in ``WAITING`` until it calls
        :meth:`unwait`."""
        waits = False
        self.flush(spin=spin)
        if handle._lane is not self:  # (the compiled flush ran its batch whole)
            return False
        self.try_progress()  # (often decided already: then no flags, no fence)
        if handle._lane is not self:
            return False
        end = time.perf_counter() + (self.spin_s if spin and self._engine_idle() else 0.0)  # (a polling caller
        # holds the GIL the engine thread needs for its own work)
        self._set_awake(1)
        self._active_until = float("inf")
        try:
            while handle._lane is self and time.perf_counter() < end:
                self.try_progress()
                if handle._lane is not self:
                    break
                os.sched_yield()
        finally:
            self._active_until = 0.0
            self._set_awake(-1)
            mine = self.page[self.rank]
            mine[RUNG] = 0
            if handle._lane is self:  # a caller sleeps on the lane: posts and decisions ring us now
                waits = True
                with self.lock:
                    self._waiting += 1
                    mine[WAITING] = self._waiting
            if waits or self.rank == 0 or self._waiting:  # then look once more: a doorbell skipped
                _fence()  # while we were awake is not lost (rank 0: a peer's call to decide;
                self.progress()  # others: a decision for a caller of ours asleep)
            if handle._lane is self:
                self._call_rank0()
                self._wake_engine()  # the engine thread takes over (and times rank 0's escalations)
        return waits

    def unwait(self) -> None:
        """A caller that :meth:`drive` sent to sleep has its result."""
        with self.lock:
            self._waiting -= 1
            self.page[self.rank][WAITING] = self._waiting

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

    # -- any thread -----------------------------------------------------------------------------
    def busy(self) -> bool:
        """Whether the engine thread has lane work: requests held here, a doorbell, (rank 0) a
        position some rank holds a request at (or a join) to decide, or :data:`_BACKLOG`
        positions only the engine runs to decide or consume (a burst's, done lazily)."""
        page, decided = self.page, self.page[0][DECIDED]
        if self._out or self._batch is not None or page[self.rank][RUNG] or decided - self._done >= _BACKLOG:
            return True
        return self.rank == 0 and any(page[q][LATEST] > decided or page[q][POSTED] - decided >= _BACKLOG
                                      for q in range(self.size))

    def engine_turn(self) -> Optional[float]:
        """The engine thread's turn: run the lane unless a caller runs it (it posted within
        :data:`GRACE_S` or polls now).  Returns the seconds after which to look again (a
        doorbell may end the wait earlier), or None when the lane has nothing to do."""
        if not self.busy():
            return None
        left = self._active_until - time.monotonic()
        if left > 0:  # (drive() wakes the engine if it stops before its handle is done)
            return max(min(left, 1.0), _TICK_S)
        self.flush(engine_thread=True)  # (a batch nobody waited for)
        mine = self.page[self.rank]
        mine[RUNG] = 0  # rings from now on wake us again
        _fence()
        seen = self._first_seen  # rank 0: the next escalation
        state = (self.page[0][DECIDED], self._posted, tuple(self.page[q][POSTED] for q in range(self.size)))
        if state != self._state or seen is not None and time.monotonic() >= seen[1] + ESCALATE_S:
            self.progress()  # (not while nothing changed: the engine thread comes here every cycle)
            self._state = state
        if not self.busy():
            return None
        seen = self._first_seen
        if self._batch is not None:  # (left for want of room: look again soon)
            return _TICK_S
        return 0.1 if seen is None else max(_TICK_S, seen[1] + ESCALATE_S - time.monotonic())

    def progress(self) -> None:
        """Decide (rank 0) and consume what can be; requests the lane gives up go to the engine."""
        with self.lock:
            self._progress()
            engine = self._take_handoff()
        if engine:
            self._to_engine(engine)

    def try_progress(self) -> None:
        """:meth:`progress` unless another thread is running the lane (never blocks)."""
        if self.lock.acquire(blocking=False):
            self._progress_and_release()

    def _progress_and_release(self) -> None:
        """(The lock held: released here.) :meth:`_progress`, then hand the engine what it gave up."""
        try:
            self._progress()
            engine = self._take_handoff()
        finally:
            self.lock.release()
        if engine:
            self._to_engine(engine)

    def poll(self, handle) -> None:
        """For ``handle.done()``: move the lane on once (:meth:`try_progress`) and, if ``handle``
        still waits for rank 0's decision, ring rank 0."""
        self.flush()
        self.try_progress()
        if handle._lane is self:
            _fence()
            self._call_rank0()

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

    # -- inside the lock ------------------------------------------------------------------------
    def _take_handoff(self) -> list:
        engine, self._handoff = self._handoff, []
        return engine

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

    def _progress(self) -> None:
        out = self._out
        if self.rank == 0:
            self._decide()
        decided = self.page[0][DECIDED]
        done = min(decided, self._posted)  # (positions only the engine runs need no work)
        if out and out[0][0] >= decided and self.rank:
            done = max(done, self._fast_before_rank0(out[0][0]))
        if done <= self._done:
            return
        while out and out[0][0] < done:
            p, req = out.popleft()
            if self.held.pop(req.name, None) is not req:
                continue
            verdict = self.dec[p % DEPTH] if p < decided else FAST
            if type(req) is _Batch:
                self._consume_batch(p, req, verdict)
                continue
            self.counts["fast" if verdict == FAST else "slow"] += 1
            req.handle._lane = None
            if verdict != FAST:
                self._handoff.append(req)
                continue
            try:
                result = (self._broadcast(p, req) if req.kind == "broadcast" else self._device_reduce(req)
                          if req.device is not None else self._reduce(p, req))
            except Exception as e:  # noqa: BLE001 - this request fails, not the lane
                req.handle._set(error=e)
            else:
                req.handle._set(result=result)
        if self._deferred and not self.held:
            for req in self._deferred:
                req.handle._lane = None
            self._handoff += self._deferred
            self._deferred = []
        if 0 < min(done, decided) and self.dec[(min(done, decided) - 1) % DEPTH] == OFF:  # (OFF is for good:
            self.off = True  # the last position tells)
        self._done = done
        self.page[self.rank][DONE] = done  # (after the reductions read the peers' copies)

    def _equal(self, p: int) -> bool:
        """Whether every rank posted position ``p`` with this rank's record."""
        page, i = self.page, (p % DEPTH) * _REC
        sig = self.rec[self.rank][i]
        for q in range(self.size):
            if page[q][POSTED] <= p or self.rec[q][i] != sig:
                return False
        return True

    def _fast_before_rank0(self, p: int) -> int:
        """Position ``p``'s records are everyone's and equal (a held request's: positive): FAST, as rank 0
        will decide, unless it has claimed ``p`` (:meth:`_claim`: it may decide otherwise); so this
        rank consumes ``p`` without waiting for rank 0.  Returns ``p + 1``, or 0 (wait for rank 0).
        The records are read before the claim, rank 0 stores the claim before it reads them."""
        return p + 1 if self._equal(p) and self.page[0][CLAIM] <= p else 0

    def _claim(self, upto: int) -> list:
        """Rank 0, before a decision that is not the records' own (a position some rank has not
        posted, decided on time or on what was posted after it): no rank decides positions below
        ``upto`` FAST by itself from now on (:meth:`_fast_before_rank0`).  Returns the posts
        counts read after the claim is visible: a position complete then may have been
        consumed FAST already, and is decided by its records."""
        page = self.page
        if page[0][CLAIM] < upto:
            page[0][CLAIM] = upto
            _fence()
        return [page[q][POSTED] for q in range(self.size)]

    def _decide(self) -> None:
        """Rank 0: decide every position that can be, in order; ring the ranks that posted them.
        A position every rank posted is decided by its records alone (OFF with a join, SLOW if a
        signature is 0 or two differ, else FAST), as any rank may decide it FAST by itself; the
        rest (:meth:`_decide_incomplete`) only after :meth:`_claim`."""
        n, page, k = self.size, self.page, self._decided
        posts = [page[q][POSTED] for q in range(n)]
        last = max(posts)
        if last <= k:  # (nothing new: the common poll)
            return
        start = k
        top = self._floor + DEPTH  # (a decision's slot is free for reuse)
        if top < last:
            top = self._min_done() + DEPTH
        top = min(last, top)
        end = min(last - 1, top)
        if end - k >= 2 and self._closing is None:  # (a burst for the engine: SLOW at once, as far as the
            far = posts.index(last)  # furthest rank's records are 0)
            if self.rec[far][(k % DEPTH) * _REC] == 0:
                at = np.arange(k, end) % DEPTH
                zero = self._rec_np[far][at, 0] == 0
                run = len(at) if zero.all() else int(zero.argmin())
                self._dec_np[at[:run]] = SLOW
                k += run
        rec, dec, complete = self.rec, self.dec, min(min(posts), top)
        if complete - k >= 8 and self._ctx is not None:  # (a batch's or a burst's positions: at once, in C)
            k = self._ctx.decide(k, complete, SLOW, JOIN_SIG)
        while complete - k >= 8:  # (or with slices, to the ring's end at a time)
            at = k % DEPTH
            run = min(complete - k, DEPTH - at)
            sigs = [self._rec_np[q][at:at + run, 0] for q in range(n)]
            if any((s == JOIN_SIG).any() for s in sigs):
                break
            fast = sigs[0] > 0
            for s in sigs[1:]:
                fast &= s == sigs[0]
            self._dec_np[at:at + run] = np.where(fast, FAST, SLOW)
            k += run
        while k < complete:  # (every rank posted it)
            i = (k % DEPTH) * _REC
            sigs = [rec[q][i] for q in range(n)]
            sig = sigs[0]
            if sig > 0 and sigs.count(sig) == n:
                verdict = FAST
            elif JOIN_SIG in sigs:
                if self._closing is None:
                    self._closing = min(self._claim(1 << 62))
                verdict = OFF
            else:
                verdict = SLOW
            dec[k % DEPTH] = verdict
            k += 1
        if k < top:
            k, posts = self._decide_incomplete(k, top, posts)
        if k > start:
            self._publish(k, [q for q in range(1, n) if posts[q] > start])

    def _publish(self, k: int, ring) -> None:
        """Rank 0: the decisions below position ``k`` are written: count them, then ring the ranks
        of ``ring`` (those that posted some) whose caller sleeps on a lane handle (a polling
        caller or a later post sees them)."""
        self._first_seen = None
        self._decided = k
        self.page[0][DECIDED] = k  # last: the decisions are visible before their count
        _fence()
        for q in ring:
            if self.page[q][WAITING]:
                self._ring(q)

    def _decide_incomplete(self, k: int, top: int, posts: list):
        """Rank 0: decide from position ``k`` (below ``top``), which some rank has not posted:
        SLOW if what was posted differs or holds a 0, OFF once a join was seen, else SLOW once a
        rank posted requests for the engine after it or :data:`ESCALATE_S` passed, each after
        :meth:`_claim`.  Returns the next position to decide and the posts counts last read."""
        n, page = self.size, self.page
        if self._closing is None and any(page[q][JOINED] for q in range(n)):
            posts = self._claim(1 << 62)  # (a joined rank posts nothing more: every position not complete
            self._closing = min(posts)  # now is OFF; none is decided FAST by a rank alone any more)
        while k < top:
            i = (k % DEPTH) * _REC
            sigs = [self.rec[q][i] for q in range(n) if posts[q] > k]
            if JOIN_SIG in sigs or self._closing is not None and k >= self._closing:
                if self._closing is None:
                    posts = self._claim(1 << 62)
                    self._closing = min(posts)
                    continue
                verdict = OFF
            elif min(sigs) <= 0 or sigs.count(sigs[0]) != len(sigs):
                verdict = SLOW
            elif len(sigs) == n:
                verdict = FAST
            else:
                if not any(posts[q] > max(page[q][LATEST], k + 1) for q in range(n)):  # (else a rank posted
                    # requests for the engine after it and after its last lane request: they wait on this one)
                    now = time.monotonic()
                    if self._first_seen is None or self._first_seen[0] != k:
                        self._first_seen = (k, now)
                        break
                    if now - self._first_seen[1] < ESCALATE_S:
                        break
                fresh = self._claim(k + 1)
                if all(fresh[q] > k for q in range(n)):  # (complete now: by its records)
                    posts = fresh
                    continue
                verdict = SLOW
            self.dec[k % DEPTH] = verdict
            k += 1
        return k, posts

    def _consume_batch(self, p: int, b, verdict: int) -> None:
        """Position ``p``, batch ``b``, was decided: FAST, every request gets its part of one
        reduction of the packed copies; else every request goes to the engine, in order."""
        self.counts["batches"] += 1
        self.counts["fast" if verdict == FAST else "slow"] += len(b.arrays)
        if verdict != FAST:
            self._handoff += b.to_engine(self._request)
            return
        try:
            parts = self._reduce(p, b)
        except Exception as e:  # noqa: BLE001 - these requests fail, not the lane
            b.fail(e)
            return
        b.done(parts)

    def _broadcast(self, p: int, req):
        """Position ``p``, a broadcast, was decided FAST: a copy of the root's."""
        a = req.array
        i = (p % DEPTH) * _REC
        off, got = self.rec[req.root][i + 1], self.rec[req.root][i + 2]
        if got != a.nbytes or not 0 <= off <= DATA_BYTES - got:
            raise errors.ProtocolError(f"rank {self.rank}: rank {req.root}'s fast-lane record for '{req.name}' "
                                       f"is malformed (offset {off}, {got} bytes, expected {a.nbytes})")
        out = fusion.aligned_empty(a.dtype, a.size)  # (aligned: the TF face wraps it without a copy)
        np.copyto(out, self.data[req.root][off:off + got].view(a.dtype))
        return out.reshape(a.shape)

    def _reduce(self, p: int, req):
        """Position ``p``, an allreduce, was decided FAST: reduce every rank's copy, in rank
        order, into a new array (``req.out`` if given); returns the request's result."""
        if type(req) is _Batch:  # (the packed copies; the parts of the result)
            dtype, size, out = req.dtype, req.layout.count, None
        else:
            dtype, size, out = req.array.dtype, req.array.size, req.out
        views = self._copies(p, req.name, dtype, size)
        result = self._result_array(dtype, size) if out is None else out.reshape(-1)
        collectives.reduce_copies(UFUNCS[req.op], views, result, accumulation_dtype(dtype),
                                  self._float_scale(req, dtype))
        self._int_scale(result, req)
        if req.layout is not None:
            return req.layout.views(result)
        return result.reshape(req.array.shape) if out is None else out

    def _copies(self, p: int, name: str, dtype: np.dtype, size: int) -> list:
        """Every rank's copy of position ``p`` (``size`` elements of ``dtype``), in rank order;
        raises :class:`ProtocolError` for a record of another size or outside the data ring."""
        isz, i = dtype.itemsize, (p % DEPTH) * _REC
        nbytes, typed = size * isz, self._typed.get(dtype) or self._typed_views(dtype)
        views = []
        for q in range(self.size):
            off, got = self.rec[q][i + 1], self.rec[q][i + 2]
            if got != nbytes or off % isz or not 0 <= off <= DATA_BYTES - nbytes:
                raise errors.ProtocolError(f"rank {self.rank}: rank {q}'s fast-lane record for '{name}' "
                                           f"is malformed (offset {off}, {got} bytes, expected {nbytes})")
            views.append(typed[q][off // isz:off // isz + size])
        return views

    def _typed_views(self, dtype: np.dtype) -> list:
        """Every rank's data ring as an array of ``dtype`` (slicing it is ~3x cheaper than a
        byte slice and a view), in rank order."""
        if len(self._typed) >= _SIGS_MAX:
            self._typed.clear()
        typed = self._typed[dtype] = [self.data[q].view(dtype) for q in range(self.size)]
        return typed


class _Scaling:
    """What integer scaling reads of a request (``Runtime._int_scale``)."""

    __slots__ = ("op", "postscale")

    def __init__(self, op, postscale: float):
        self.op, self.postscale = op, postscale


class _Batch:
    """Small allreduces of one burst (one dtype, op and postscale), gathered in the caller's
    thread and posted as one position (:meth:`Lane._flush_batch`).  Per part: its input
    (``arrays``) and its name (``order``); ``own`` pairs a part submitted with a
    :class:`Request` with its index (a part :meth:`Lane.burst` took has none: its caller holds a
    :class:`PartHandle` of the batch's ``handle``).  ``handle`` gives the
    list of the parts' results, or, once the batch went to the engine (:meth:`to_engine`), the
    list of the parts' handles there."""

    __slots__ = ("own", "arrays", "names", "order", "name", "dtype", "op", "postscale", "nbytes", "layout",
                 "handle")
    kind, prescale = "allreduce", 1.0

    def __init__(self, req, names: dict, lane):
        self.own, self.arrays, self.order, self.name = [], [], [], f"{req.name} (batch)"
        self.names = names  # (the lane's: every name in a batch it gathers or holds)
        self.dtype, self.op, self.postscale = req.array.dtype, req.op, req.postscale
        self.nbytes = 0
        self.layout = None  # (set when posted)
        self.handle = Handle(self.name)
        self.handle._lane = lane

    def takes(self, req, size: int) -> bool:
        """Whether ``req`` (a burst's) joins this batch: an allreduce of a host array of its
        dtype, op and postscale, no prescale, not a group, a name not in any batch of the lane,
        and the batch's bytes stay readable (:data:`READ_BYTES`)."""
        return (req.kind == "allreduce" and req.prescale == 1.0 and req.layout is None and req.device is None
                and self.fits(req.name, req.array, req.op, req.postscale, size))

    def fits(self, name: str, a, op, postscale: float, size: int) -> bool:
        """Whether an allreduce named ``name`` of ``a`` with ``op`` and ``postscale`` fits this batch
        (:meth:`takes`'s checks of the array, op and scale; :meth:`Lane.burst`'s)."""
        return (type(a) is np.ndarray and a.dtype == self.dtype and op is self.op and postscale == self.postscale
                and len(self.arrays) < _BATCH_MAX and a.nbytes > 0
                and (self.nbytes + a.nbytes + _ALIGN) * (size - 1) <= READ_BYTES and name not in self.names)

    def add(self, req) -> None:
        self.own.append((len(self.arrays), req))
        self._add(req.name, req.array)

    def add_part(self, name: str, a) -> PartHandle:
        """Add the allreduce of ``a`` named ``name`` (:meth:`fits` it) without a request; its handle."""
        self._add(name, a)
        return PartHandle(name, self.handle, len(self.arrays) - 1)

    def _add(self, name, a) -> None:
        self.arrays.append(a)
        self.names[name] = self
        self.order.append(name)
        self.nbytes += a.nbytes + _ALIGN  # (at most: each part starts on a cache line)

    def _release(self) -> None:
        """The lane no longer holds the batch: its names may be batched again."""
        names, order = self.names, self.order
        if len(names) == len(order) and names.get(order[0]) is self:  # (the common case: only ours there,
            names.clear()  # as a name is in one batch at a time and nothing is added after a clear)
        else:
            for name in order:
                if names.get(name) is self:  # (Lane.fail_all clears them first)
                    del names[name]
        self.handle._lane = None

    def done(self, parts: list) -> None:
        """Decided FAST and reduced: every part gets its result (``parts``: views of one array;
        copied into a request's ``out`` where it has one)."""
        self._release()
        for i, r in self.own:  # (the parts :meth:`Lane.burst` took have the batch's handle)
            part = parts[i]
            r.handle._lane = None
            if r.out is not None:
                np.copyto(r.out, part)
                part = r.out
            r.handle._set(result=part)
        self.handle._set(result=parts)

    def fail(self, err: BaseException) -> None:
        """Every part fails with ``err``."""
        self._release()
        for _, r in self.own:
            r.handle._lane = None
            r.handle._set(error=err)
        self.handle._set(error=err)

    def to_engine(self, request) -> list:
        """The parts as requests for the engine, in order (``request``: the Request class, for
        the parts :meth:`Lane.burst` took); the batch's handle then gives each part's handle."""
        self._release()
        given = dict(self.own)
        reqs = [given.get(i) or request.burst(name, a, self.op, self.postscale)
                for i, (name, a) in enumerate(zip(self.order, self.arrays))]
        for r in reqs:
            r.handle._lane = None
        self.handle._set(result=[r.handle for r in reqs])
        return reqs
