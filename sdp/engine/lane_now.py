"""The fast lane's calls run whole in the caller (a part of :mod:`sdp.engine.lane`): a
synchronous allreduce of host memory (:meth:`LaneNow.allreduce_now`, a flattened group's too) or
of device memory (:meth:`LaneNow.device_now`) posted, polled for and reduced without a Request,
a handle or the engine thread, and the glue of the compiled step (``cc/lane_now.c``, built by
:mod:`sdp.engine.native`): its Context, and teaching its entries (``front``, ``front_group``) the
names and groups they then run whole.  Kept apart because this is the latency path and its own
contract with the C code; :class:`LaneNow` is a mixin of :class:`sdp.engine.lane.Lane`.

A **synchronous allreduce** (``sdp.allreduce``) runs whole in its caller while the lane is idle
(:meth:`Lane.allreduce_now`): posted, polled for and reduced into its result without a
:class:`Request` or a handle; what is not consumed while it polls becomes a held request.
A synchronous allreduce of **device memory** (:meth:`Lane.device_now`) is posted the same way
with a record that carries no data: its caller first packs its input where every peer reads it
(:mod:`sdp.engine.device_path`'s lane windows), and once every rank posted the same signature each
reduces every rank's copy there.
Where :mod:`sdp.engine.native` builds, its common case (post, poll, reduce) is one compiled call
(``cc/lane_step.c``) that hands everything else back to this code; ``sdp.allreduce`` calls its
entry (:attr:`Lane.front`) first, which runs a learnt name's call whole, checks, allocation and
result included, and goes on in :meth:`Lane._finish_now` where the common case ends;
``sdp.grouped_allreduce`` calls :attr:`Lane.front_group` the same way for a learnt group
(:meth:`Lane.learn_group`), packing included, and :meth:`Lane.flush` the compiled flush for a
learnt batch (:meth:`Lane._learn_batch`): its positions posted, polled for and reduced in one call.
"""
import logging
import os
import time
from typing import Optional

import numpy as np

from sdp.common.reduce_ops import UFUNCS, ReduceOp, accumulation_dtype
from sdp.engine import collectives
from sdp.engine.lane_reduce import _Scaling
from sdp.engine.lane_ring import (_BACKLOG, _NATIVE_DTYPES, _NATIVE_OPS, _NATIVE_PYTHON, _NATIVE_RECORD, _REC,
                                  _SIGS_MAX, AWAKE, CLAIM, DATA_BYTES, DECIDED, DEPTH, DONE, FAST, LATEST,
                                  NOW_READ_BYTES, POSTED, RUNG, WAITING, _fence)

log = logging.getLogger("sdp.engine")


class LaneNow:
    """Synchronous calls run whole in the caller, and the compiled step's glue (a mixin of
    :class:`sdp.engine.lane.Lane`)."""

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
