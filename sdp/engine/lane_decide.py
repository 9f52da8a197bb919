"""Who runs the fast lane and what it decides (a part of :mod:`sdp.engine.lane`): a waiting
caller's polling (:meth:`LaneDecisions.drive`) or the engine thread's turn
(:meth:`LaneDecisions.engine_turn`), rank 0's decisions of positions in order, consuming the
decided positions, and the hand-off of what the lane gives up to the engine.  Kept apart from the
memory (:mod:`sdp.engine.lane_ring`) and the reductions (:mod:`sdp.engine.lane_reduce`) so the
protocol — who decides what, when, and who is rung — reads in one place.  :class:`LaneDecisions`
is a mixin of :class:`sdp.engine.lane.Lane` (its methods use the Lane's attributes).

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
* OFF once any rank posted ``join()``: the lane stays off until that join completed on every rank
  (a joined rank posts nothing more, so positions could never fill); then
  :meth:`sdp.engine.lane.Lane.rearm` turns it on again at one position on every rank.

A position every rank posted is decided by its records alone (OFF with a join's, SLOW with a 0
or two that differ, else FAST), so a rank that sees every record of its held request equal
**consumes it FAST without waiting for rank 0** (:meth:`Lane._fast_before_rank0`), unless rank 0
has *claimed* the position (``CLAIM``): before any other decision (on time, on what was posted
after it, after a join) rank 0 stores the claim, fences, and reads the posts again, deciding by
the records what is complete by then (Dekker's pattern again: a rank reads the records, then the
claim; so either it sees the claim or rank 0 sees the records it saw; see the doorbells below).

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
"""
import os
import time
from typing import Optional

import numpy as np

from sdp.engine.lane_batch import _Batch
from sdp.engine.lane_ring import (_BACKLOG, _REC, CLAIM, DECIDED, DEPTH, DONE, FAST, JOIN_SIG, JOINED, LATEST, OFF,
                                  POSTED, RUNG, SLOW, WAITING, _fence)

ESCALATE_S = 0.005  # seconds a position waits for a rank that has not posted it, then SLOW
_TICK_S = 0.001  # the engine thread's shortest sleep (a poll's timeout is whole milliseconds; never spin:
# a spinning engine thread holds the GIL the caller needs back after every numpy call)


class LaneDecisions:
    """Who runs the lane, rank 0's decisions, consuming decided positions and the hand-off to the
    engine (a mixin of :class:`sdp.engine.lane.Lane`)."""

    def _engine_idle(self) -> bool:
        """Whether the engine thread has no work (then a waiting caller polls)."""
        engine = self._engine
        return engine is None or not (engine._pending or engine._queue)

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

    def _take_handoff(self) -> list:
        engine, self._handoff = self._handoff, []
        return engine

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
        if self._armed < min(done, decided) and self.dec[(min(done, decided) - 1) % DEPTH] == OFF:  # (OFF lasts
            self.off = True  # until rearm(): the last position since tells)
        self._done = done
        self.page[self.rank][DONE] = done  # (after the reductions read the peers' copies)

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
