"""Synchronous small allreduces across hosts in the caller's thread: a host's ranks through shared
memory, the hosts' leaders over a TCP link of their own (:mod:`sdp.transport.tcp_link`, issue 30).

Across hosts a small allreduce otherwise costs two trips through rank 0 (the request, then the
response carrying the result: :mod:`sdp.engine.inline`), each through the engine threads and
ZeroMQ's I/O threads of both ends.  Here ``sdp.allreduce`` (synchronous, every rank, no process
set) runs whole in the calling thread, hierarchically, with no coordinator:

1. Every rank **posts** its call as position ``k`` (its count of such calls): a signature (a
   62-bit hash of name, dtype, shape, op and postscale; 0 for a call this path does not run) and
   a copy of its input in its slot of the host's shared memory (the fast lane's region of its
   segment, unused in a job across hosts), the position stored last.
2. The host's **leader** (its lowest rank) waits for every local rank's post of ``k``, reduces
   the local copies in rank order when their signatures agree (the host's signature, else 0) and
   sends ``(k, host signature, partial)`` to every other leader over the link; then waits for
   theirs.
3. Every leader decides alike from the same messages: **FAST** when every host's signature is the
   same and not 0 (the partials reduced in host order, then scaled: the same operations on every
   leader, so every rank gets the same bits), **OFF** when a rank posted ``join()`` (the path
   stays off for the rest of the job: a joined rank posts nothing more), else **SLOW**.  It
   publishes the decision (and the result) in its slot; the other local ranks wait for it.
4. FAST returns the result; SLOW and OFF send the call to the engine on every rank, which
   negotiates it as before: mismatches and stalls raise there, with their names.

No position is decided by anyone's clock, so the ranks never disagree; the price is that a call
waits here for every rank's post of the same position, as a synchronous collective waits for its
peers anyway.  Every synchronous global allreduce posts (``sdp.allreduce`` of anything: one this
path does not run posts 0), and nothing else does, so positions line up across ranks whenever
the ranks make the same synchronous allreduces in the same order; ranks that do not (a program
that would deadlock under Horovod too) wait here with a stall warning after
``SDP_STALL_CHECK_TIME`` naming the ranks not heard from, and :class:`StallError` when set
``SDP_STALL_SHUTDOWN_TIME`` has passed: rank 0's stall check's, on every rank, when some rank waits
in the engine meanwhile, else this wait's own, :data:`STALL_GRACE_S` later.  A lost peer or a failed engine ends the wait with its
error (checked every :data:`CHECK_S`; a lost peer through the engine thread, which fails the job
with it and tells the peers which rank was lost, as when it waits itself).  Waits on shared memory spin (yielding the core) for
:data:`SPIN_S`, then poll every :data:`NAP_S`; a leader waits on the link in ``poll``.

*Eligible* (signature not 0): a C-contiguous float32/float64/int32/int64 host array of 1 to
:data:`MAX_BYTES` bytes, SUM/AVERAGE/MIN/MAX/PRODUCT, no prescale, ``out`` absent or of its
shape and dtype, no timeline being written on this rank.  The result's bits can differ from the
engine's in the last place for 3 or more ranks (another order of the sums), as with the fast
lane.  On in jobs across hosts (:attr:`sdp.transport.zmq_mesh.Mesh.link_on`: every rank offered
it, x86-64 stores in order, shared memory on hosts with several ranks) unless
``SDP_FAST_LANE=0`` or ``SDP_ENCRYPT=1`` (the link's TCP is not encrypted).

*Compiled* (``sdp/engine/cc/link_now.c``'s ``LinkFront``, where the fast lane's extension builds:
:mod:`sdp.engine.native`): :attr:`HostLink.front` (the runtime's ``front``) runs a call of a
name this path has run before whole in C, and :meth:`_native_step` a position the Python path
began, as far as its common case goes (every rank FAST in time); the rest continues here
(:meth:`_resume`, the codes ``NATIVE_*``).  Without it all of the above runs in Python, with the
same bits.

Link messages: one frame, ``MAGIC, position (u64), host signature (i64), bytes (u64)`` packed,
then the partial's bytes when the signature is positive.  A message that is not that (size, magic, a
position other than this one or the next, a length that does not match) is logged and dropped.
"""
import logging
import os
import struct
import threading
import time
import types
from typing import Dict, Optional

import numpy as np

from sdp.common import errors
from sdp.common.reduce_ops import UFUNCS, ReduceOp
from sdp.engine import collectives, fusion, native
from sdp.engine.coordinator import stop_hint
from sdp.engine.lane import _NATIVE_DTYPES, _NATIVE_OPS, signature

log = logging.getLogger("sdp.engine")

MAX_BYTES = 64 << 10  # an eligible input's largest size (bytes): slot, result and message
SPIN_S = 0.002  # seconds a wait on shared memory spins (yielding the core) before it naps
NAP_S = 0.0002  # seconds between polls after that
CHECK_S = 0.01  # seconds between checks for a lost peer, a failed engine, a stall
LOST_GRACE_S = 0.5  # seconds a wait gives the engine thread to fail the job once a peer is lost
STALL_GRACE_S = 2.0  # seconds after SDP_STALL_SHUTDOWN_TIME a wait gives rank 0's stall check (it
# names the tensors and ranks on every rank, where some rank waits in the engine) before it raises
_HDR = 8  # int64 slots of a rank's slot header
POST, SIG, RES, DECISION = range(4)  # header slots (RES, DECISION: a leader's, for its host)
FAST, SLOW, OFF = 1, 2, 3
DONE = 4  # (FAST, the result written by the compiled step)
JOIN_SIG = -1
NATIVE_DONE, NATIVE_LOCAL, NATIVE_SENT, NATIVE_SKIP = 1, 0, -1, 2  # the compiled step's codes (cc/link_now.c)
MAGIC = b"SDPL"
_MSG = struct.Struct("<4sQqQ")
_INBOX_SLOT = 4 + _MSG.size + MAX_BYTES  # bytes per host of the compiled step's frames (cc/link_now.c LK_SLOT)
_KEPT = 64 + MAX_BYTES  # bytes per message a leader keeps (cc/link_now.c LK_KEPT): at 32 its frame, at 64 the partial
_DTYPES = frozenset(("<f4", "<f8", "<i4", "<i8"))


class HostLink:
    """The path of the module docstring for rank ``rt.rank`` of runtime ``rt`` (its mesh's link
    sockets and, on a host with several ranks, ``rt.mesh.host_shm``)."""

    def __init__(self, rt, request):
        self.rt, self._request = rt, request  # (request: sdp.engine.runtime.Request, for _resume)
        mesh = rt.mesh
        self.mesh, self.rank, self.size = mesh, rt.rank, rt.size
        hosts = [p["host"] for p in sorted(mesh.peers, key=lambda p: int(p["rank"]))]
        self.local = [q for q in range(self.size) if hosts[q] == hosts[self.rank]]
        self.leader = self.local[0]
        self.leaders = mesh.leaders()  # (host order)
        self.lock = threading.Lock()
        self.k = 0  # positions posted
        self.off = False
        self.fast = 0  # allreduces completed here (for tests and benchmarks)
        self.compiled = 0  # of which the compiled step ran whole
        self._early: Dict[tuple, tuple] = {}  # (leader, position) -> (signature, bytes) come ahead
        self._sigs: Dict[tuple, int] = {}
        self._lost_at: Optional[float] = None  # when this position's wait first saw a lost peer
        self.hdr = self.data = self.res = None
        #: (a leader's) its last two messages, position k's in slot k % 2 (length-prefixed frame
        #: at 32, its partial at 64: the compiled step reduces into it and sends it from there),
        #: resent on a repaired link connection (:meth:`_history`)
        self._kept = fusion.aligned_empty(np.uint8, 2 * _KEPT) if self.rank == self.leader else None
        if self._kept is not None:
            self._kept[:] = 0
            mesh.link.history = self._history
        if len(self.local) > 1:
            seg = mesh.host_shm
            off = seg.lane_offset()
            self.hdr = {q: seg.at(q, off, np.int64, _HDR) for q in self.local}
            self.data = {q: seg.at(q, off + 8 * _HDR, np.uint8, MAX_BYTES) for q in self.local}
            self.res = seg.at(self.leader, off + 8 * _HDR + MAX_BYTES, np.uint8, MAX_BYTES)
        #: the compiled step (sdp/engine/cc/link_now.c's LinkFront), or None: everything in Python
        self._native = None
        self._nat: Dict[int, Optional[tuple]] = {}  # signature -> (reduction code, float scale) or None
        #: ``front(name, a, op, postscale, out)``: sdp.allreduce whole in C for a name this path has
        #: run (else None: go on in allreduce_now); None without the extension
        self.front = None
        module = native.load()
        if module is not None:
            me = self.local.index(self.rank) if self.hdr is not None else 0
            leader = self.rank == self.leader
            self._native = module.LinkFront(
                self, rt, mesh.link if leader else None, list(self.leaders),
                tuple(self.hdr[q] for q in self.local) if self.hdr is not None else (),
                tuple(self.data[q] for q in self.local) if self.hdr is not None else (), self.res, self._kept,
                fusion.aligned_empty(np.uint8, _INBOX_SLOT * len(self.leaders)) if leader else None,
                me, self.leaders.index(self.leader), SPIN_S, CHECK_S)
            self.front = self._native.front

    # -- the calls ------------------------------------------------------------------------------
    def allreduce_now(self, name: str, a, op, postscale: float, out: Optional[np.ndarray]):
        """``sdp.allreduce(a, name, op, postscale_factor=postscale, out=out)`` of every rank:
        the result (``out`` when given, else a new array), or None where the call must go to the
        engine (not eligible here, SLOW or OFF).  Raises the engine's error once it failed,
        :class:`PeerLostError` once a peer is lost, :class:`StallError` (see the module
        docstring)."""
        with self.lock:
            if self.off:
                return None
            sig = self._signature(name, a, op, postscale, out)
            if not sig:
                self._run(0, None)
                return None
            if self.hdr is None and out is not None and np.may_share_memory(a, out):
                a = a.copy()  # (alone on its host, the leader's input is its host's partial: kept whole)
            result = fusion.aligned_empty(a.dtype, a.size) if out is None else out
            nat = self._native_args(sig, a, op, postscale)
            decision, copies = self._run(sig, a, UFUNCS[op], nat, result.reshape(-1))
            if nat is not None and self.rt.timeline is None and type(postscale) is float and type(name) is str:
                self._native.learn(name, a.dtype, a.shape, op, postscale, sig, *nat)  # (front() runs it next time)
            return self._finish(decision, copies, a, op, postscale, out, result)

    def _resume(self, k: int, sig: int, a, result, step: int, frames: list, name: str, op, postscale: float, out):
        """The rest of position ``k`` the compiled entry (``front``) began and handed back
        (``step``, the frames it read): holding :attr:`lock`, which this lets go, with
        ``rt.link_busy`` set.  The result, or the engine's where the position is not FAST."""
        try:
            try:
                for h, body in frames:
                    self._take(self.leaders[h], [body], k)
                decision, copies = self._position(sig, a, UFUNCS[op], None, result.reshape(-1), (k, step))
            finally:
                self.rt.link_busy = False
            got = self._finish(decision, copies, a, op, postscale, out, result)
        finally:
            self.lock.release()
        if got is None:  # (SLOW or OFF: the engine, as sdp.api.allreduce goes on)
            return self.rt.submit(self._request(name, "allreduce", a, op, None, 1.0, postscale, None, out, 0)).wait()
        return got

    def _finish(self, decision: int, copies, a, op, postscale: float, out, result):
        """The result of a position decided ``decision`` (``copies``: the hosts' partials on a
        leader whose decision is FAST), written into ``result``; None unless FAST or DONE."""
        if decision not in (FAST, DONE):
            return None
        if decision == FAST:
            flat = result.reshape(-1)
            if copies is not None and self.hdr is not None:  # (a leader: its host's ranks get the result first)
                self._reduce(copies, self.res[:a.nbytes].view(a.dtype), op, postscale)
                self._publish(FAST)
            if copies is None or self.hdr is not None:  # (the result its host's leader published)
                flat.view(np.uint8)[:] = self.res[:a.nbytes]
            else:
                self._reduce(copies, flat, op, postscale)
        self.fast += 1
        return result if out is not None else result.reshape(a.shape)

    def _reduce(self, copies: list, flat: np.ndarray, op, postscale: float) -> None:
        """The hosts' partials (in host order) reduced into ``flat``, then scaled."""
        scaling = types.SimpleNamespace(op=op, postscale=postscale)
        collectives.reduce_copies(UFUNCS[op], copies, flat, None, self.rt._float_scale(scaling, flat.dtype))
        self.rt._int_scale(flat, scaling)

    def _native_args(self, sig: int, a, op, postscale: float) -> Optional[tuple]:
        """(reduction code, float scale) of the compiled step for a call of signature ``sig``, or
        None where it does not run it (no extension; integers averaged or scaled)."""
        if self._native is None:
            return None
        try:
            return self._nat[sig]
        except KeyError:
            pass
        if len(self._nat) >= 4096:
            self._nat.clear()
        fscale = self.rt._float_scale(types.SimpleNamespace(op=op, postscale=postscale), a.dtype)
        nat = self._nat[sig] = (None if a.dtype.kind == "i" and (op == ReduceOp.AVERAGE or postscale != 1.0)
                                else (_NATIVE_DTYPES[a.dtype.str] * 4 + _NATIVE_OPS[op],
                                      1.0 if fscale is None else float(fscale)))
        return nat

    def skip(self, sig: int = 0) -> None:
        """Post a synchronous global allreduce this path does not run (``sig`` 0), or ``join()``
        (:data:`JOIN_SIG`: every rank's path turns off at this position); see the module docstring."""
        with self.lock:
            if not self.off:
                self._run(sig, None)

    def join(self) -> None:
        """Post ``join()`` (:meth:`skip` with :data:`JOIN_SIG`)."""
        self.skip(JOIN_SIG)

    # -- one position -------------------------------------------------------------------------
    def _signature(self, name, a, op, postscale, out) -> int:
        if not (a.dtype.str in _DTYPES and 0 < a.nbytes <= MAX_BYTES and a.flags.c_contiguous
                and type(op) is ReduceOp and op in UFUNCS and self.rt.timeline is None
                and (out is None or type(out) is np.ndarray and out.shape == a.shape and out.dtype == a.dtype
                     and out.flags.c_contiguous and out.flags.writeable)):
            return 0
        return signature(self._sigs, (name, a.dtype.str, a.shape, int(op), postscale))

    def _run(self, sig: int, a, ufunc=None, nat: Optional[tuple] = None, flat=None) -> tuple:
        """Post position ``k`` with ``sig`` (and ``a``'s bytes) and wait for its decision:
        ``(decision, copies)``, ``copies`` being the hosts' partials in host order on a leader
        whose decision is FAST (it reduces them with ``ufunc`` and publishes the result), else
        None; DONE where the compiled step (``nat``: :meth:`_native_args`) ran it whole, its
        result in ``flat``."""
        self.rt.link_busy, self._lost_at = True, None
        try:
            return self._position(sig, a, ufunc, nat, flat)
        finally:
            self.rt.link_busy = False

    def _position(self, sig: int, a, ufunc, nat, flat, resume: Optional[tuple] = None) -> tuple:
        """Position ``k`` (the next, or ``resume``'s: ``(k, code)`` of the compiled step that began
        it) to its decision: see :meth:`_run`."""
        if resume is None:
            k = self.k = self.k + 1
            step = self._native_step(k, sig, a, nat, flat) if nat is not None and sig > 0 else None
        else:
            k, step = resume
        nbytes = a.nbytes if sig > 0 else 0
        if step == NATIVE_SKIP:  # (an input or output not aligned: nothing done)
            step = None
        elif step == NATIVE_DONE:
            self.compiled += 1
            return DONE, None
        if self.hdr is not None and step is None:
            mine = self.hdr[self.rank]
            if nbytes and self.rank != self.leader:  # (the leader reads its own input where it is)
                self.data[self.rank][:nbytes] = a.reshape(-1).view(np.uint8)
            mine[SIG] = sig
            mine[POST] = k  # (last: x86-64 keeps stores in order)
        if self.rank != self.leader:
            lead = self.hdr[self.leader]
            self._wait(lambda: lead[RES] >= k, k, lambda: [self.leader])
            decision = int(lead[DECISION])
            if decision == OFF:
                self.off = True
            return decision, None
        if step == NATIVE_SENT:  # (the compiled step sent this host's partial)
            at = (k & 1) * _KEPT + 64
            host_sig, partial = sig, self._kept[at:at + nbytes].view(a.dtype)
        else:
            host_sig, partial = self._host_partial(k, sig, a, nbytes, ufunc)
            head = _MSG.pack(MAGIC, k, host_sig, nbytes if host_sig > 0 else 0)
            body = head + partial.data if host_sig > 0 else head
            at = (k & 1) * _KEPT + 32
            self._kept[at:at + 4] = np.frombuffer(struct.pack("<I", len(body)), np.uint8)
            self._kept[at + 4:at + 4 + len(body)] = np.frombuffer(body, np.uint8)
            for q in self.leaders:
                if q != self.rank:
                    self.mesh.link_send(q, body)
        got = self._gather(k)
        sigs = [host_sig if q == self.rank else got[q][0] for q in self.leaders]
        if host_sig > 0 and sigs.count(host_sig) == len(sigs):
            for q, (_, body) in got.items():
                if len(body) != nbytes:  # (the same signature: the same dtype and shape)
                    raise errors.ProtocolError(f"rank {self.rank}: leader {q} sent {len(body)} bytes for "
                                               f"synchronous allreduce #{k} across hosts, not {nbytes}")
            return FAST, [partial if q == self.rank else np.frombuffer(got[q][1], a.dtype) for q in self.leaders]
        decision = OFF if JOIN_SIG in sigs else SLOW
        if self.hdr is not None:
            self._publish(decision)
        if decision == OFF:
            self.off = True
        return decision, None

    def _host_partial(self, k: int, sig: int, a, nbytes: int, ufunc) -> tuple:
        """(Leader, after its own post.) ``(host signature, host partial or None)`` of position
        ``k``, once every local rank posted it."""
        host_sig, partial = sig, (a.reshape(-1) if nbytes else None)
        if self.hdr is not None:
            hdr = self.hdr
            self._wait(lambda: all(hdr[q][POST] >= k for q in self.local), k,
                       lambda: [q for q in self.local if hdr[q][POST] < k])
            sigs = [int(hdr[q][SIG]) for q in self.local]
            host_sig = JOIN_SIG if JOIN_SIG in sigs else sig if sig > 0 and sigs.count(sig) == len(sigs) else 0
            if host_sig > 0:
                copies = [partial] + [self.data[q][:nbytes].view(a.dtype) for q in self.local[1:]]
                partial = np.empty(a.size, a.dtype)
                collectives.reduce_copies(ufunc, copies, partial, None, None)
        return host_sig, partial

    def _native_step(self, k: int, sig: int, a, nat: tuple, flat) -> Optional[int]:
        """Position ``k`` in the compiled step (sdp/engine/cc/link_now.c) as far as it goes: its
        code (NATIVE_DONE: the result in ``flat``, published for the host; NATIVE_LOCAL: posted;
        NATIVE_SENT: posted, and this leader's host partial sent, the frames it read kept here),
        or None where it did not run."""
        if self.rank != self.leader:
            return self._native.step(k, sig, a, flat, nat[0], nat[1], None)[0]
        link = self.mesh.link
        if link is None or self._early:
            return None
        fds = link.hold()
        if fds is None:
            return None
        try:
            code, frames = self._native.step(k, sig, a, flat, nat[0], nat[1], fds)
        finally:
            link.release()
        for h, body in frames:
            self._take(self.leaders[h], [body], k)
        return code

    def _history(self, dst: int) -> list:
        """(A leader; holding its link's lock, from its caller's thread.) The messages to resend on
        a new connection to leader ``dst``: the last two this leader sent, oldest first (a leader
        sends a position's only once it has every leader's previous one, so a reader can lack no
        other; the reader's position filter, :meth:`_take`, drops what it had)."""
        out = []
        for k in (self.k - 1, self.k):
            at = (k & 1) * _KEPT + 32
            n = int(self._kept[at:at + 4].view(np.uint32)[0])
            if k >= 1 and _MSG.size <= n <= _MSG.size + MAX_BYTES and \
                    _MSG.unpack_from(self._kept, at + 4)[1] == k:
                out.append(bytes(self._kept[at + 4:at + 4 + n]))
        return out

    def _publish(self, decision: int) -> None:
        """(Leader.) The decision of this position (and, FAST, the result written before it)
        for the host's other ranks."""
        mine = self.hdr[self.rank]
        mine[DECISION] = decision
        mine[RES] = self.k  # (last)

    def _gather(self, k: int) -> Dict[int, tuple]:
        """(Leader.) Every other leader's ``(host signature, bytes)`` of position ``k``."""
        want = [q for q in self.leaders if q != self.rank]
        start = last = time.monotonic()
        while True:
            if all((q, k) in self._early for q in want):
                return {q: self._early.pop((q, k)) for q in want}
            for src, frames in self.mesh.link_recv(CHECK_S * 1000):
                self._take(src, frames, k)
            now = time.monotonic()
            if now - last >= CHECK_S:
                last = now
                self._check(k, start, now, lambda: [q for q in want if (q, k) not in self._early])

    def _take(self, src: int, frames: list, k: int) -> None:
        """Keep a link message of position ``k`` or ``k + 1`` (a leader that has all of ``k`` may
        send its next); log and drop anything else."""
        try:
            magic, pos, sig, nbytes = _MSG.unpack_from(frames[0])
            body = memoryview(frames[0])[_MSG.size:]
            ok = (magic == MAGIC and pos <= k + 1 and len(frames) == 1
                  and nbytes == len(body) and (nbytes > 0) == (sig > 0) and nbytes <= MAX_BYTES)
        except (struct.error, TypeError, IndexError):
            ok = False
        if ok and (pos < k or (src, pos) in self._early):  # (resent after a repair of the link: had it)
            return
        if not ok:
            log.warning("rank %d: dropping a malformed message on the leaders' link from rank %d", self.rank, src)
            return
        self._early[(src, pos)] = (sig, body)

    def _wait(self, done, k: int, missing) -> None:
        """Wait on shared memory until ``done()``: spinning for :data:`SPIN_S`, then napping."""
        start = last = time.monotonic()
        while not done():
            now = time.monotonic()
            if now - start < SPIN_S:
                os.sched_yield()
                continue
            time.sleep(NAP_S)
            if now - last >= CHECK_S:
                last = now
                self._check(k, start, now, missing)

    def _check(self, k: int, start: float, now: float, missing) -> None:
        """Raise what ends a wait: the engine's error, a lost peer, shutdown, a stall."""
        rt = self.rt
        if rt._failed is not None:
            raise rt._failed
        if self.mesh.lost or self.mesh.link_lost:  # (the engine thread fails the job with it and tells the
            if self._lost_at is None:                # peers which rank; a link past repair is a lost rank there)
                self._lost_at = now
                rt._wake()
            elif now - self._lost_at >= LOST_GRACE_S and self.mesh.lost:
                raise self.mesh.peer_error()
        if rt._stop.is_set():
            raise errors.NotInitializedError("waiting on an allreduce across hosts: sdp was shut down")
        waited = now - start
        cfg = rt.config
        if cfg.stall_shutdown_s > 0 and waited >= cfg.stall_shutdown_s + STALL_GRACE_S:
            raise errors.StallError(f"rank {self.rank}: synchronous allreduce #{k} across hosts waited "
                                    f"{waited:.0f} s for ranks {missing()}")
        if cfg.stall_check_s > 0 and waited >= cfg.stall_check_s and waited - CHECK_S < cfg.stall_check_s:
            log.warning("rank %d: synchronous allreduce #%d across hosts has waited %.0f s for ranks %s "
                        "(another collective or order on those ranks?).%s", self.rank, k, waited, missing(),
                        stop_hint(cfg.stall_shutdown_s))
