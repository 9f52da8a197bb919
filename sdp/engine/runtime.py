"""The per-process engine: a background thread that owns the sockets, negotiates with rank 0,
fuses, and runs collectives, while the caller's threads (e.g. TensorFlow) keep computing.

Callers reach it through ``Runtime.dispatch`` (:mod:`sdp.engine.dispatch`: one entry per
collective kind, which chooses the path); the engine path is ``Runtime.submit`` of a ``Request``,
which returns a ``Handle``; ``handle.wait()`` returns the result array or raises the error every
rank sees.  How the engine thread runs a negotiated response: :mod:`sdp.engine.execute`.
"""
import collections
import logging
import os
import threading
import time
from typing import Dict, List, Optional

import numpy as np

from sdp.common import errors
from sdp.common.config import Config
from sdp.common.reduce_ops import UFUNCS, ReduceOp, accumulation_dtype
from sdp.engine import collectives, dispatch, fusion, groups, hostlink, inline, lane, process_sets
from sdp.engine.coordinator import JOIN, Coordinator, wire_dtype
from sdp.engine.handles import Handle
from sdp.engine.p2p import PointToPoint
from sdp.engine.execute import Execution
from sdp.engine.request import Request
from sdp.transport.zmq_mesh import Mesh

log = logging.getLogger("sdp.engine")

# seconds the engine keeps polling without blocking (yielding the core between polls) after it
# sent its requests: the answer usually comes within a millisecond, and a thread blocked in poll()
# takes ~0.1 ms more to wake on a small VM.  Only when this host has a core per local rank: with
# 4 ranks on 2 cores, the spinning engines slowed a 1 KB allreduce from 0.84 to 1.42 ms.
RESPONSE_SPIN_S = 0.002
# results smaller than this come from the heap, not the shared-memory result pool: a pool block
# costs ~12 us (allocation, its finalizer, its release) against ~2 us, more than the copy out of
# the segments that peers writing into it directly saves below ~64 KB
POOL_MIN_BYTES = 64 << 10


class Runtime(Execution):
    """The engine of one process: sockets, coordinator (rank 0) and the background thread."""

    def __init__(self, topology, config: Optional[Config] = None):
        self.topology = topology
        self.config = config or Config.from_env()
        self.rank, self.size = topology.rank, topology.size
        # the engine thread's wake-up pipe, polled beside the sockets; same-host peers ring it too
        # (the doorbell of sdp.transport.shm_ctrl)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # (full: the engine wakes anyway; never blocks under the lock)
        self._wake_lock = threading.Lock()  # a wake and shutdown's close never overlap (see _wake)
        try:
            self.mesh = Mesh(topology, timeout_s=self.config.timeout_s,
                             start_timeout_s=self.config.start_timeout_s,
                             shm_slab_bytes=self.config.shm_slab_bytes,
                             shm_pool_bytes=self.config.shm_pool_bytes,
                             peer_timeout_s=self.config.peer_timeout_s,
                             segment_bytes=self.config.segment_bytes, bell=(self._wake_r, self._wake_w),
                             link=self.config.fast_lane)
        except BaseException:
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise
        # local/cross values the launcher did not give, from the host names met at rendezvous
        self.topology = topology = topology.with_hosts([p["host"] for p in self.mesh.peers])
        # allreduces across hosts: shared memory on each host, ZeroMQ between (None: flat)
        self.hierarchy = groups.Hierarchy.build(self.mesh, [p["host"] for p in self.mesh.peers],
                                                self.config.hierarchical, self.config.shm_slab_bytes)
        self._queue = collections.deque()
        self._queue_lock = threading.Lock()
        self.mesh.poller.register(self._wake_r, 1)  # zmq.POLLIN
        self._pending: Dict[str, Request] = {}
        self.p2p = PointToPoint(self.rank, self._wake)  # send/recv between two ranks (sdp.engine.p2p)
        # tensor name -> (Request.key(), response-cache id): one entry per name, replaced when
        # the name is agreed with another key (the coordinator forgets the old id then)
        self._cache: Dict[str, tuple] = {}
        self._batches: Dict[int, List[dict]] = {}  # batch-cache id -> response items (announced once)
        #: process set id -> its job ranks, ascending (the same on every rank; 0, all ranks, implicit)
        self.process_sets: Dict[int, List[int]] = {}
        self._set_comms: Dict[int, process_sets.SetComm] = {}  # the sets this rank belongs to
        self._coord = Coordinator(self.size, self.config.stall_check_s, self.config.stall_shutdown_s,
                                  self.config.fusion_threshold, self.config.cache_capacity) if self.rank == 0 else None
        self._seq = 0
        self._failed: Optional[BaseException] = None
        self._aborted = threading.Event()  # set once the engine thread told the peers why it fails
        self._device_error: Optional[BaseException] = None  # a caller's device failure (_lane_device): the
        # engine thread fails the job with it
        self._stop = threading.Event()
        self._last_request_at = 0.0
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._spin_s = RESPONSE_SPIN_S if topology.local_size <= cores else 0.0
        self.timeline = None  # set by sdp.engine.timeline when enabled
        self._device = None  # sdp.engine.device_path.DevicePath, made when a device array first runs
        ctrl = self.mesh.ctrl
        #: sdp.engine.lane.Lane: small allreduces when every rank is on this host (None: off).  Its
        #: results come from the heap: only this rank writes them (a result pool block, made for
        #: peers to write into, costs its finalizer and release: 100 x 4 KB grouped 78-87 -> 74-79 us,
        #: grouped async 152-179 -> 150-167 us, alternating in one job, one outlier each way)
        self.lane = (lane.Lane(self.mesh, self._enqueue, self._wake, fusion.aligned_empty, self._float_scale,
                               self._int_scale, self.config.timeout_s, lane.SPIN_S if self._spin_s else 0.0,
                               self, Request, self._lane_device_reduce)
                     if self.config.fast_lane and ctrl is not None and ctrl.bells and self.mesh.shm is not None
                     and self.mesh.shm.lane_bytes
                     and all(ctrl.senders.values()) else None)
        #: the compiled step's entry for sdp.allreduce (Lane.front: front(name, a, op, postscale, out) ->
        #: result, or None to go on as below), None without it or once stopping or failed
        self.front = self.lane.front if self.lane is not None else None
        #: the same for sdp.grouped_allreduce (Lane.front_group: front_group(names, arrays, op, postscale,
        #: fusion threshold) -> the results, or None to go on as sdp.api._grouped_submit does)
        self.front_group = self.lane.front_group if self.lane is not None else None
        #: the lane's open batch, for sdp.allreduce_async (Lane.burst_front(name, a, op, postscale) -> handle,
        #: or None to submit as usual), None without a lane or once stopping or failed
        self.burst = self.lane.burst_front if self.lane is not None else None
        #: small allreduces ride the negotiation across hosts (sdp.engine.inline); rank 0's stash
        self._inline = self.config.fast_lane and self.size > 1 and self.mesh.shm is None
        self._stash = inline.Stash(self.size) if self._inline and self._coord is not None else None
        self.inline_allreduces = 0  # allreduces completed inline (for tests and benchmarks)
        #: sdp.engine.hostlink.HostLink: synchronous small allreduces across hosts in the caller's
        #: thread, through the host leaders' link (None: off; also once stopping or failed)
        self.link = hostlink.HostLink(self, Request) if self.mesh.link_on else None
        if self.link is not None:  # (its compiled entry for sdp.allreduce, as the lane's on one host)
            self.front = self.link.front
        self.link_busy = False  # a caller waits in the link: a lost peer fails the engine (_waits_on_lost)
        #: the entries sdp.api calls, one per collective kind, and their ordered tables of paths
        self.dispatch = dispatch.Dispatch(self)
        self._thread = threading.Thread(target=self._run, name=f"sdp-engine-{self.rank}", daemon=True)
        self._thread.start()

    # -- caller side -------------------------------------------------------------------------
    def usable(self) -> bool:
        """Neither failed nor stopping: the in-caller paths may run a call (``sdp.engine.dispatch``)."""
        return self._failed is None and not self._stop.is_set()

    def device_now(self, req: Request):
        """The result of synchronous allreduce ``req`` of device memory (every rank, no prescale),
        run whole in the calling thread through the fast lane and the device path's own windows
        (``Lane.device_now``, ``DevicePath.lane_pack``); None where they do not take it
        now (nothing done: submit ``req``).  The first device collective always goes to the
        engine, which opens the windows."""
        dp = self._device
        if (self.lane is None or dp is None or req.prescale != 1.0 or req.ps or not self.usable()
                or not dp.lane_takes(req)):
            return None
        try:
            return self.lane.device_now(req, lambda: self._lane_device(dp.lane_pack, req))
        except errors.SdpError:
            if self._device_error is not None:  # (the lane's lock let go: peers hear why before this rank leaves)
                self._aborted.wait(self.config.timeout_s)
            raise

    def _lane_device_reduce(self, req: Request):
        return self._lane_device(self._device.lane_reduce, req, *self._device_args(req))

    def _lane_device(self, fn, *args):
        """``fn(*args)``: device work of ``device_now`` in whichever thread runs it.  A failure
        there (a CUDA error: out of memory, a bad pointer) fails the job as one in the engine
        thread does: raised here as ``SdpError``, and by the engine thread, which tells
        every peer why before it leaves (they raise within the usual bounds)."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - any device failure ends the job on every rank
            err = errors.SdpError(f"rank {self.rank}: device path failed: {e!r}")
            log.error("%s", err)
            self._device_error = err
            self._wake()
            raise err from e

    def submit(self, req: Request) -> Handle:
        """Queue ``req`` for the background thread; returns its handle at once.

        Raises the engine's fatal error (e.g. ``PeerLostError``) if it has already failed."""
        self.submit_many((req,))
        return req.handle

    def submit_many(self, reqs: List[Request]) -> List[Handle]:
        """Queue several requests at once: they reach the coordinator in one message, so they
        are scheduled (and fused) together."""
        if self._failed is not None:
            raise self._failed
        if self._stop.is_set():
            raise errors.NotInitializedError(f"'{reqs[0].name}' ({reqs[0].kind}) after shutdown()")
        handles = [r.handle for r in reqs]
        if self.lane is not None:
            reqs = self.lane.post(reqs)  # the fast lane keeps what it may run (sdp.engine.lane)
        if reqs:
            self._enqueue(reqs)
        return handles

    def submit_p2p(self, send: bool, array: np.ndarray, peer: int, tag: int) -> Handle:
        """Queue a send to or a receive from ``peer`` (``sdp.engine.p2p``); its handle.  Raises
        the engine's fatal error if it has already failed."""
        if self._failed is not None:
            raise self._failed
        if self._stop.is_set():
            raise errors.NotInitializedError(f"{'send' if send else 'recv'}() after shutdown()")
        return self.p2p.submit(send, array, peer, tag)

    def _enqueue(self, reqs: List[Request]) -> None:
        """Queue ``reqs`` for the engine thread (any thread) and wake it."""
        for req in reqs:
            req.fill()
        with self._queue_lock:
            wake = not self._queue  # else the engine has been woken and not yet taken the queue
            self._queue.extend(reqs)
        if wake:
            self._wake()

    def _wake(self) -> None:
        """Wake the engine thread (any thread; nothing after shutdown).  The descriptor is read and
        written under the lock shutdown takes to retire it: a number closed in between is soon
        another file's, which would get the byte."""
        with self._wake_lock:
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"x")
                except BlockingIOError:  # full: the engine thread has bytes to wake it
                    pass

    def shutdown(self) -> None:
        """Stop the thread, fail whatever is still pending, and close the sockets (says BYE)."""
        if self._stop.is_set():
            return
        self.front = self.front_group = self.burst = self.link = None
        self._stop.set()
        self._wake()
        self._thread.join(timeout=2.0)  # let a collective in flight finish
        self.mesh.stopping = True  # then cut any wait short
        self._thread.join(timeout=30.0)
        self._fail_all(errors.NotInitializedError("waiting on a collective: sdp was shut down"))
        if self._device is not None and not self._thread.is_alive():
            self._device.close()
        with self._wake_lock:
            wake_r, wake_w, self._wake_w = self._wake_r, self._wake_w, -1  # (a late _wake writes nowhere)
        os.close(wake_r)
        os.close(wake_w)

    # -- background thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._cycle()
        except BaseException as e:  # noqa: BLE001 - any engine failure must reach every caller
            if not isinstance(e, errors.SdpError):
                log.exception("rank %d: engine failed", self.rank)
                e = errors.SdpError(f"rank {self.rank}: engine failed: {e!r}")
            self._failed = e
            self.front = self.front_group = self.burst = self.link = None
            self._fail_all(e)
            # peers learn why, then see us disconnect, and fail fast too
            self.mesh.abort(getattr(e, "rank", None) if isinstance(e, errors.PeerLostError) else None, str(e))
            self._aborted.set()
            return
        self.mesh.close()

    def _cycle(self) -> None:
        if self._device_error is not None:
            raise self._device_error
        cycle_s = self.config.cycle_time_ms / 1000.0
        wait_ms = 1000.0
        if self._queue:
            wait_ms = max(0.0, (self._last_request_at + cycle_s - time.monotonic()) * 1000)
        spin = (self._pending and not self._queue
                and time.monotonic() - self._last_request_at < self._spin_s)
        if spin:
            wait_ms = 0.0
        lane_s = self.lane.engine_turn() if self.lane is not None else None
        if lane_s is not None:
            wait_ms = min(wait_ms, lane_s * 1000)
        p2p_ms = self.p2p.poll_ms()
        if p2p_ms is not None:
            wait_ms = min(wait_ms, p2p_ms)
        self.mesh.pump(wait_ms)
        if spin:
            os.sched_yield()
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        self._handle_control()  # first: answers that arrived before a peer left still count
        if self.p2p.busy():
            self.p2p.run(self.mesh)
            if self.mesh.lost:
                self.p2p.fail_lost(self.mesh.lost)
        if (self.mesh.lost and (self._pending or self._queue or lane_s is not None or self.link_busy)
                and self._waits_on_lost()):
            raise self.mesh.peer_error()
        if self._queue and time.monotonic() >= self._last_request_at + cycle_s:
            self._send_requests()
        if self._coord is not None:
            self._check_stalls()

    def _waits_on_lost(self) -> bool:
        """Whether a pending or queued collective needs a lost peer: every global one does (and
        everything, once rank 0, the coordinator, is gone); a process set's only its members.
        (A rank outside a set may finish and leave while the set's members still run its
        collectives.)"""
        lost = self.mesh.lost
        if 0 in lost or self.link_busy or self.lane is not None and self.lane.held:
            return True
        with self._queue_lock:
            reqs = list(self._queue)
        for req in reqs + list(self._pending.values()):
            if not req.ps or not lost.keys().isdisjoint(self.process_sets.get(req.ps, ())):
                return True
        return False

    def _send_requests(self) -> None:
        new, ids, inl = [], [], []
        with self._queue_lock:
            batch, self._queue = self._queue, collections.deque()
        for req in batch:
            if req.name in self._pending:
                req.handle._set(error=ValueError(
                    f"a collective named '{req.name}' is already in flight on rank {self.rank}; "
                    "names must be unique among outstanding collectives"))
                continue
            self._pending[req.name] = req
            hit = self._cache.get(req.name)
            if hit is not None and hit[0] == req.key():
                ids.append(hit[1])
            else:
                new.append(req.meta())
            if self._inline and self._coord is None and len(batch) == 1 and inline.eligible(req, self.size):
                inl.append(req)  # (a lone request: several are fused better by the collective)
            if self.timeline:
                self.timeline.begin(req.name, "NEGOTIATE")
        self._last_request_at = time.monotonic()
        msg = {"t": "req", "new": new, "ids": ids}
        if self._coord is not None:
            self._coordinate(0, msg)
            return
        if inl:  # (this rank's inputs, after the JSON: sdp.engine.inline)
            msg["in"], msg["il"] = [r.name for r in inl], [r.array.nbytes for r in inl]
        self.mesh.send_ctrl(0, inline.encode(msg, [r.array.reshape(-1) for r in inl]))

    def _handle_control(self) -> None:
        for src in range(self.size):
            for body in self.mesh.recv_ctrl(src):
                try:
                    msg, tail = inline.decode(body)
                    kind = msg["t"]
                except (ValueError, KeyError, IndexError, TypeError):
                    log.warning("rank %d: dropping malformed control message from rank %d", self.rank, src)
                    continue
                if kind == "req" and self._coord is not None:
                    if self._stash is not None and src > 0:
                        self._stash.add(src, msg, tail)
                    self._coordinate(src, msg)
                elif kind == "resp" and src == 0:
                    items = self._response_items(msg)
                    if items is None:
                        log.warning("rank %d: dropping malformed response %.200r", self.rank, msg)
                        continue
                    self._execute(items, self._inline_in(msg, items, tail))
                elif kind == "abort" and src == 0:
                    raise errors.StallError(str(msg.get("err", "rank 0 aborted the job")))
                else:
                    log.warning("rank %d: dropping unexpected control message %r from rank %d",
                                self.rank, kind, src)

    def _response_items(self, msg: dict) -> Optional[List[dict]]:
        """The items of a response: sent in full, or (a cached batch) by its ``bid`` alone; None
        if ``msg`` is malformed (no items, items that are not named objects, an unknown batch)."""
        items, bid = msg.get("items"), msg.get("bid")
        if bid is not None and type(bid) is not int:
            return None
        if items is not None and not (isinstance(items, list)
                                      and all(isinstance(i, dict) and isinstance(i.get("n"), str) for i in items)):
            return None
        if bid is None:
            return items
        if items is not None:
            self._batches[bid] = items
        return self._batches.get(bid)

    def _inline_in(self, msg: dict, items: List[dict], tail: memoryview) -> Dict[str, memoryview]:
        """The results rank 0 sent inline with response ``msg`` (``"st"``), by name; raises
        ``ProtocolError`` when they do not fit the items (sdp.engine.inline)."""
        st = msg.get("st")
        if st is None:
            return {}
        cut = inline.pieces(st, tail)
        if cut is None or not all(type(i) is int and 0 <= i < len(items) for i, _ in st):
            raise errors.ProtocolError(f"rank {self.rank}: rank 0's response carries malformed inline results")
        return {items[i]["n"]: view for (i, _), view in zip(st, cut)}

    def _inline_out(self, items: List[dict]) -> Dict[str, np.ndarray]:
        """Rank 0: reduce the items every rank sent inline (sdp.engine.inline), by name."""
        out, total = {}, 0
        for it in items:
            got = self._stash.take(it["n"])
            req = self._pending.get(it["n"])
            if (got is None or "err" in it or "jm" in it or it.get("ps") or self.timeline or req is None
                    or not inline.eligible(req, self.size) or total + req.array.nbytes > inline.MESSAGE_BYTES
                    or any(len(v) != req.array.nbytes for v in got.values())):
                continue
            a = req.array.reshape(-1)
            res = fusion.aligned_empty(a.dtype, a.size) if req.out is None else req.out.reshape(-1)
            collectives.reduce_copies(UFUNCS[req.op], [a] + [np.frombuffer(got[q], a.dtype) for q in range(1, self.size)],
                                      res, accumulation_dtype(a.dtype), self._float_scale(req, a.dtype))
            self._int_scale(res, req)
            out[it["n"]] = res
            total += a.nbytes
        return out

    def _broadcast_ctrl(self, msg: dict, arrays=()) -> None:
        body = inline.encode(msg, list(arrays))
        lost = self.mesh.lost  # (a lost rank some pending collective needs fails it: _waits_on_lost)
        for r in range(1, self.size):
            if r not in lost:
                self.mesh.send_ctrl(r, body)

    def _coordinate(self, src: int, msg: dict) -> None:
        errs = self._coord.add(src, msg)
        items = self._coord.ready()
        bid = getattr(items, "bid", None)  # a cached batch: after the first time, send just its id
        if errs:
            items, bid = errs + items, None
        if not items:
            return
        done = self._inline_out(items) if self._stash is not None else {}
        extra = {"st": [[i, done[it["n"]].nbytes] for i, it in enumerate(items) if it["n"] in done]} if done else {}
        arrays = [done[items[i]["n"]] for i, _ in extra["st"]] if done else ()
        if bid is None:
            self._broadcast_ctrl({"t": "resp", "items": items, **extra}, arrays)
        elif self._batches.get(bid) is items:  # (a forgotten batch's number is reused by a new one)
            self._broadcast_ctrl({"t": "resp", "bid": bid, **extra}, arrays)
        else:
            self._batches[bid] = items
            self._broadcast_ctrl({"t": "resp", "bid": bid, "items": items, **extra}, arrays)
        self._execute(items, done)

    def _check_stalls(self) -> None:
        warnings, fatal = self._coord.stalls()
        for w in warnings:
            log.warning(w)
        if fatal:
            self._broadcast_ctrl({"t": "abort", "err": fatal})
            raise errors.StallError(fatal)

    # -- execution ------------------------------------------------------------------------------
    def _execute(self, items: List[dict], inl=None) -> None:
        device = [self._pending[i["n"]] for i in items
                  if "err" not in i and i["n"] in self._pending and self._pending[i["n"]].device is not None]
        joined = JOIN in self._pending and any(i.get("jm", {}).get("dev") for i in items if "err" not in i)
        if not device and not joined:
            return self._execute_items(items, inl)
        dp = self._device_path(device[0].device if device else None)
        with dp.lock, dp.backend:
            for req in device:  # (allreduces: in _allreduce_bucket, which may stage them directly)
                if req.kind != "allreduce" and not dp.uses_ipc(req.ps):
                    dp.stage_in(req)
            self._execute_items(items)

    def _device_path(self, tensor):
        if self._device is None:
            from sdp.engine.device_path import DevicePath
            self._device = DevicePath(self)
        self._device.start(tensor)
        return self._device

    def device_counters(self) -> dict:
        """Bytes the device path moved (``d2h``, ``h2d``, ``d2d``) and kernels it launched, plus
        ``ipc`` (whether the IPC path is in use) and ``hierarchical`` (IPC windows per host, parts
        allreduced across hosts) and ``lane`` (device allreduces the fast lane ran in the calling
        thread); zeros before any device array ran."""
        dp = self._device
        if dp is None or dp.backend is None:
            return {"d2h": 0, "h2d": 0, "d2d": 0, "kernels": 0, "ipc": False, "backend": None, "hierarchical": False,
                    "lane": 0}
        return {**dp.backend.counters, "ipc": dp.ipc, "backend": dp.backend.name,
                "hierarchical": dp.ipc and dp.hier is not None, "lane": dp.lane_runs}

    def _execute_items(self, items: List[dict], inl=None) -> None:
        """Run response ``items`` in order; ``inl``: results that came inline, by name."""
        reduce_items = []
        for item in items:
            if "err" in item:
                req = self._pending.pop(item["n"], None)
                if req is not None:
                    self._timeline_mark(req.name, "NEGOTIATE", None)
                    req.handle._set(error=errors.TensorMismatchError(item["err"]))
                continue
            if item["n"] == JOIN:
                self._timeline_mark(JOIN, "NEGOTIATE", None)
                self._complete(self._pending[JOIN], int(item["last"]))
                continue
            req = self._pending.get(item["n"])
            submitted = req is not None
            if req is None and "jm" in item and JOIN in self._pending:
                req = self._zeros_for_join(item["jm"])
            if req is None and item.get("ps"):
                continue  # a collective of a process set this rank is not in
            if req is None:
                raise errors.ProtocolError(f"rank {self.rank}: coordinator scheduled '{item['n']}', "
                                           "which this rank did not submit")
            if "meta" in item and req.kind not in ("allgather", "alltoall"):
                # (allgather/alltoall metas differ per rank in the first dimension / splits, so
                # rank 0's agreed meta would be wrong for the others: those always travel in full)
                self._cache[req.name] = (req.key(), item["id"])
            if self.timeline:
                self._timeline_mark(req.name, "NEGOTIATE" if submitted else None, "QUEUE")
            if inl and req.name in inl:
                self._complete_inline(req, inl[req.name])
            elif req.kind == "allreduce":
                reduce_items.append(item)
            else:
                self._run_single(req, item)
        buckets: Dict[int, List[Request]] = {}  # the coordinator's fusion plan ("b": bucket index)
        for item in reduce_items:
            buckets.setdefault(item["b"], []).append(self._pending[item["n"]])
        for bucket in buckets.values():
            self._allreduce_bucket(bucket)

    def _complete_inline(self, req: Request, got) -> None:
        """Complete ``req`` with its result from the response (bytes; rank 0: the array)."""
        a = req.array
        if not isinstance(got, np.ndarray):
            if req.kind != "allreduce" or req.device is not None or len(got) != a.nbytes:
                raise errors.ProtocolError(f"rank {self.rank}: rank 0 sent an inline result of {len(got)} bytes "
                                           f"for '{req.name}' ({req.kind} of {a.nbytes} bytes here)")
            out = fusion.aligned_empty(a.dtype, a.size) if req.out is None else req.out.reshape(-1)
            np.copyto(out, np.frombuffer(got, a.dtype))
            got = out
        self._timeline_mark(req.name, "QUEUE", None)
        self.inline_allreduces += 1
        self._complete(req, got.reshape(a.shape) if req.out is None else req.out)

    def _timeline_mark(self, name: str, ends: Optional[str], begins: Optional[str]) -> None:
        """Timeline: phase ``ends`` of tensor ``name`` is over, phase ``begins`` starts."""
        if self.timeline:
            if ends:
                self.timeline.end(name, ends)
            if begins:
                self.timeline.begin(name, begins)

    def _zeros_for_join(self, meta: dict) -> Request:
        """A rank that has joined contributes zeros to the allreduces the others still run (in
        device memory when theirs are device arrays)."""
        dtype = wire_dtype(meta["d"])
        zeros = np.zeros(meta["s"], dtype)
        if meta.get("dev"):
            zeros = self._device.to_device(zeros)
        req = Request(meta["n"], "allreduce", zeros, op=ReduceOp(meta["o"]),
                      prescale=meta["pre"], postscale=meta["post"])
        self._pending[req.name] = req
        if req.device is not None and not self._device.uses_ipc(req.ps):
            self._device.stage_in(req)
        return req

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _result_array(self, dtype: np.dtype, count: int) -> np.ndarray:
        """A new 1-D result array: from the shared-memory result pool when there is room (peers
        then write into it directly) and it holds at least ``POOL_MIN_BYTES``, else from
        the heap."""
        seg = self.mesh.shm if self.hierarchy is None else self.hierarchy.host.shm
        pool = seg.pool if seg is not None and count * dtype.itemsize >= POOL_MIN_BYTES else None
        got = pool.alloc(dtype, count) if pool is not None else None
        return fusion.aligned_empty(dtype, count) if got is None else got[1]

    def _complete(self, req: Request, result, staged: bool = True) -> None:
        del self._pending[req.name]
        if req.device is not None:  # (a device group's result is already the list of its parts')
            if staged:  # a device array staged through host memory
                result = self._device.stage_out(req.device, result)
        elif req.layout is not None:
            result = req.layout.views(result.reshape(-1))
        req.handle._set(result=result)

    def add_process_set(self, ps: int, ranks: List[int]) -> None:
        """Register process set ``ps`` (1 .. ``process_sets.MAX_SET_ID``) of job ranks ``ranks``
        (ascending).  Every rank registers the same sets with the same ids (``sdp.api`` does)."""
        ranks = [int(r) for r in ranks]
        if self.rank in ranks:
            self._set_comms[ps] = process_sets.SetComm(self.mesh, ps, ranks)
        self.process_sets[ps] = ranks
        if self._coord is not None:
            self._coord.sets[ps] = ranks

    def remove_process_set(self, ps: int) -> None:
        """Forget process set ``ps`` (its id is not reused)."""
        self.process_sets.pop(ps, None)
        self._set_comms.pop(ps, None)
        if self._coord is not None:
            self._coord.sets.pop(ps, None)

    @property
    def fusion_threshold(self) -> int:
        """Bytes per fusion bucket as this rank last set it (rank 0's value is the one used)."""
        return self.config.fusion_threshold

    def set_fusion_threshold(self, nbytes: int) -> None:
        """Bytes per fusion bucket from now on (0 disables fusion).  Rank 0's value decides:
        the coordinator plans the buckets for every rank."""
        if nbytes < 0:
            raise ValueError(f"fusion threshold must be >= 0 bytes, got {nbytes}")
        self.config.fusion_threshold = int(nbytes)
        if self._coord is not None:
            self._coord.fusion_threshold = int(nbytes)

    def _fail_all(self, err: BaseException) -> None:
        with self._queue_lock:
            batch, self._queue = self._queue, collections.deque()
        for req in batch:
            req.handle._set(error=err)
        for req in list(self._pending.values()):
            req.handle._set(error=err)
        self._pending.clear()
        self.p2p.fail_all(err)
        if self.lane is not None:
            self.lane.fail_all(err)
