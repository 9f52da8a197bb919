"""Collectives on device (GPU) arrays: the engine's device path.

Every rank of the job runs the same collectives in the same order (the coordinator's), so the
decisions here are made alike on every rank without talking about them, except the one exchange
of window handles (below).

**IPC path** (every rank on this host, at most :data:`MAX_LOCAL` of them, ``SDP_GPU_IPC`` not 0):
each rank owns two *windows*, device allocations exported with inter-process handles and opened
once by every peer (the exporter keeps them alive until shutdown).  Windows are as large as the
largest collective needs (at least the fusion threshold, 25 MB); they grow together, since every
rank computes the same size from the agreed request, and the handles are exchanged again (an
allgather over the mesh) when they do.  Collectives use the two windows in turn (every rank runs
the same collectives in the same order, so all agree on whose turn it is).  A collective:

1. packs this rank's input(s) into its window of this turn (one gather launch for a fused bucket);
2. barrier (:mod:`sdp.engine.barrier`; each rank's device work is synchronised before it posts);
3. reads the peers' windows directly, writing into a new allocation per bucket (each tensor a
   view of it), with no host staging and no device-to-host copy:

   - allreduce, *one shot* (2 ranks, or a bucket of at most :data:`ONE_SHOT_BYTES`): every rank
     reduces the whole bucket from every window into its result;
   - allreduce, *two shots* (more ranks, larger buckets): the bucket is cut into n chunks (64-byte
     edges); rank r reduces chunk r of every window into its result and into its own window;
     a second barrier; then it copies the peers' reduced chunks out of their windows;
   - reducescatter reduces this rank's rows into its result; allgather, broadcast and alltoall
     copy the peers' blocks into the result;
4. the device is synchronised and the result handed out.  No barrier is needed at the end: a peer
   reads this turn's window until it posts the first barrier of its next collective, and this
   rank writes the same window again only in the collective after that, past that barrier.

**In the calling thread** (:meth:`DevicePath.lane_pack`, :meth:`DevicePath.lane_reduce`, driven by
:meth:`sdp.engine.lane.Lane.device_now`): a synchronous allreduce of every rank on the IPC path of
one host, in one shot, once the windows are open, is packed by its caller into a second pair of
windows (exported and grown with the first), agreed through the fast lane (a record without data:
every rank packed before it posted, so no barrier) and reduced by the caller from every rank's
lane window with the one-shot kernel above; no engine thread, no negotiation.  The lane's windows
alternate per collective decided FAST, alike on every rank.

**Host-staged path** (ranks on several hosts, process sets, ``SDP_GPU_IPC=0``, a window that
cannot be opened on some rank, more than :data:`MAX_LOCAL` local ranks): the input is copied to
host memory (page-locked), the host collective runs as for numpy arrays, and the result is copied
back to a new device allocation.  Which path runs, and why, is logged once.

Results are synchronised before they are handed out, and go back as the input's own kind
(:meth:`sdp.engine.device_arrays.DeviceTensor.wrap_result`).
"""
import logging
import os
import struct
import threading
from typing import List, Optional

import numpy as np

from sdp.common.reduce_ops import UFUNCS, ReduceOp
from sdp.engine import barrier, collectives, fusion
from sdp.engine.backends import Allocation, Backend, NumpyBackend, accumulation_type
from sdp.engine.device_arrays import DeviceGroup, DeviceTensor, same_kind

log = logging.getLogger("sdp.engine.device")

MAX_LOCAL = 8  # ranks of one host the IPC path serves (sources of one reduce launch)
MAX_HANDLE = 128  # bytes of an exported handle (CUDA's is 64; a shm path fits too)
WINDOWS = 2  # windows per rank the engine thread uses in turn
LANE_WINDOWS = 2  # and the ones the fast lane uses in turn (device allreduces in the calling thread)
ONE_SHOT_BYTES = 1 << 20  # with more than 2 ranks, larger allreduce buckets take two shots
_RECORD = struct.Struct("<q" + f"B{MAX_HANDLE}s" * (WINDOWS + LANE_WINDOWS))  # window bytes, then each
# handle's length and bytes


def backend_name() -> str:
    """``SDP_DEVICE_BACKEND`` (``cuda``, the default, or ``numpy``)."""
    return (os.environ.get("SDP_DEVICE_BACKEND") or "cuda").lower()


def make_backend(device_id: int, name: Optional[str] = None) -> Backend:
    """The backend for device arrays of ``device_id``: ``name`` or :func:`backend_name`.
    ``RuntimeError`` naming the cause when PyCUDA or a device is missing."""
    name = (name or backend_name()).lower()
    if name == "numpy":
        return NumpyBackend()
    if name != "cuda":
        raise ValueError(f"SDP_DEVICE_BACKEND={name!r}: expected 'cuda' or 'numpy'")
    try:
        from sdp.engine.cuda_backend import CudaBackend
    except ImportError as e:
        raise RuntimeError(f"a CUDA device array reached sdp, but PyCUDA is not importable ({e}); "
                           "install sdp[cuda]") from e
    return CudaBackend(device_id)


class DevicePath:
    """The device path of one :class:`~sdp.engine.runtime.Runtime` (built on first use)."""

    def __init__(self, runtime):
        self.rt = runtime
        self.mesh = runtime.mesh
        self.backend = None
        self.windows: List[Allocation] = []  # this rank's, one per turn
        self.peers: List[List[int]] = []  # per turn, every rank's window pointer (this rank's at its rank)
        self._opened: List[Allocation] = []
        self._turn = 0
        self._lane_turn = 0
        self.lane_runs = 0  # device allreduces the fast lane ran in a calling thread
        #: held by whichever thread runs device work: the engine thread, or a caller running a
        #: device allreduce in the fast lane (they share the backend's stream and buffers)
        self.lock = threading.Lock()
        hosts = {p["host"] for p in self.mesh.peers}
        setting = runtime.config.gpu_ipc
        self.hier = runtime.hierarchy  # ranks on several hosts: windows among this host's ranks
        self.comm = self.mesh if self.hier is None else self.hier.host  # the ranks that share windows
        why = None
        if setting is False:
            why = "SDP_GPU_IPC=0"
        elif len(hosts) > 1 and self.hier is None:
            why = f"the ranks span {len(hosts)} hosts, without a hierarchy (one rank per host, or SDP_HIERARCHICAL=0)"
        elif self.comm.size > MAX_LOCAL:
            why = f"{self.comm.size} ranks on this host (the IPC path serves up to {MAX_LOCAL})"
        self.ipc = why is None
        self._why_staged = why
        self._said = False
        self._pinned = None

    # -- set-up ------------------------------------------------------------------------------------
    def start(self, tensor: Optional[DeviceTensor]):
        """The backend for ``tensor``'s device (made on first use, in the engine thread); without
        a tensor (a rank that joined contributes zeros to device allreduces), device
        ``local_rank % device count``, as Horovod's scripts pin one GPU per local rank."""
        if self.backend is None:
            dev = tensor.device_id if tensor is not None else -2
            if dev < 0 and backend_name() == "cuda":
                from sdp.engine import cuda_backend
                dev = (cuda_backend.pointer_device(tensor.ptr) if tensor is not None
                       else self.rt.topology.local_rank % cuda_backend.device_count())
            self.backend = make_backend(max(dev, 0))
            seg = self.mesh.shm or getattr(self.rt.hierarchy, "host", None) and self.rt.hierarchy.host.shm
            try:  # this rank's shared memory, where staged arrays and results live
                with self.backend:
                    self._pinned = self.backend.pin(seg.mine) if seg is not None else None
            except Exception as e:  # noqa: BLE001 - slower copies, still correct
                log.warning("rank %d: cannot page-lock shared memory for host staging: %s", self.rt.rank, e)
            log.info("rank %d: device path on %s device %d", self.rt.rank, self.backend.name, dev)
        return self.backend

    def uses_ipc(self, ps: int) -> bool:
        if ps or not self.ipc:
            if not self._said:
                self._said = True
                log.warning("rank %d: device arrays are staged through host memory (%s)", self.rt.rank,
                            "a process set" if ps and self.ipc else self._why_staged)
            return False
        return True

    def _ensure_window(self, nbytes: int) -> bool:
        """Every rank's windows hold at least ``nbytes`` (all ranks call this with the same
        value); False, on every rank, if some rank could not open a peer's window."""
        if self.windows and self.windows[0].nbytes >= nbytes:
            return True
        b = self.backend
        size = max(nbytes, self.rt.config.fusion_threshold, 1 << 20)
        if self.windows:
            size = max(size, 2 * self.windows[0].nbytes)
        self._opened, self.windows, self.peers = [], [], []
        own = [b.alloc(size, exportable=True) for _ in range(WINDOWS + LANE_WINDOWS)]
        handles = [b.ipc_export(a) or b"" for a in own]
        if max(len(h) for h in handles) > MAX_HANDLE:
            raise ValueError(f"{b.name} window handle of {max(len(h) for h in handles)} bytes (at most {MAX_HANDLE})")
        records = self._allgather_bytes(_RECORD.pack(size, *[x for h in handles for x in (len(h), h)]))
        ptrs, opened, ok = [[] for _ in own], [], all(handles)
        for q, rec in enumerate(records):
            qsize, *fields = _RECORD.unpack(rec)
            for k in range(WINDOWS + LANE_WINDOWS):
                hlen, qhandle = fields[2 * k], fields[2 * k + 1]
                if q == self.comm.rank:
                    ptrs[k].append(own[k].ptr)
                    continue
                if not ok or hlen == 0 or qsize < nbytes:
                    ok = False
                    break
                try:
                    a = b.ipc_open(qhandle[:hlen], qsize)
                except Exception as e:  # noqa: BLE001 - any failure to map a peer: stage through the host
                    log.warning("rank %d: cannot open rank %d's device window (%s)", self.rt.rank,
                                getattr(self.comm, "ranks", range(self.comm.size))[q], e)
                    ok = False
                    break
                opened.append(a)
                ptrs[k].append(a.ptr)
        verdicts = self._allgather_bytes(bytes([ok]), self.mesh)  # the whole job takes one path
        for a in own:
            b.ipc_unlink(a)
        if not all(v[0] for v in verdicts):
            bad = [q for q, v in enumerate(verdicts) if not v[0]]
            self.ipc = False
            self._why_staged = f"rank(s) {bad} could not open a peer's device window"
            return False
        self.windows, self.peers, self._opened = own, ptrs, opened
        return True

    def _next_window(self):
        """This turn's window: (this rank's window pointer, every rank's, in rank order)."""
        k, self._turn = self._turn, (self._turn + 1) % WINDOWS
        return self.windows[k].ptr, self.peers[k]

    def _allgather_bytes(self, record: bytes, comm=None) -> List[bytes]:
        comm = comm or self.comm
        n, r = comm.size, comm.rank
        width = len(record)
        buf = np.zeros(n * width, np.uint8)
        buf[r * width:(r + 1) * width] = np.frombuffer(record, np.uint8)
        collectives.allgatherv(comm, buf, [q * width for q in range(n + 1)], self.rt._next_seq(),
                               self.rt.config.segment_bytes)
        return [buf[q * width:(q + 1) * width].tobytes() for q in range(n)]

    def _sync(self, seq: int, step: int) -> None:
        self.backend.synchronize()
        barrier.sync(self.comm, seq, step)

    # -- results -------------------------------------------------------------------------------------
    def _tensor(self, dtype, shape, alloc: Allocation, offset: int = 0) -> DeviceTensor:
        """The array at ``alloc.ptr + offset`` (bytes), keeping ``alloc`` alive."""
        res = DeviceTensor(alloc.ptr + offset, shape, dtype, self.backend.device_id, _Owner(alloc, self.backend),
                           "module")
        res.device_type = self.backend.device_type
        return res

    def _result(self, like: DeviceTensor, dtype, shape, alloc: Allocation, offset: int = 0):
        """The result at ``alloc.ptr + offset`` (bytes), as ``like``'s kind."""
        return like.wrap_result(self._tensor(dtype, shape, alloc, offset))

    def _results(self, tensors: List[DeviceTensor], offs: List[int], alloc: Allocation) -> list:
        """The results of a bucket of ``tensors`` (the requests' inputs) reduced into ``alloc`` at
        element offsets ``offs``: for each tensor a view of its place, as its kind (a group: the
        list of its parts' views).  Views of one array of the whole bucket where the kinds agree
        and allow (CuPy: a ``cupy.ndarray`` each), else a result object per place."""
        dtype = tensors[0].dtype
        size, likes, places = dtype.itemsize, [], []
        for t, off in zip(tensors, offs):
            likes.extend(t.parts)
            places.extend(t.views(off * size))
        views = None  # (one group's parts are of one kind by construction: api._grouped_submit's plan)
        if len(places) > 1 and (len(tensors) == 1 or same_kind(likes)):
            views = likes[0].wrap_views(self._tensor(dtype, (offs[-1],), alloc), places)
        if views is None:
            views = [self._result(like, dtype, shape, alloc, off) for like, (off, shape) in zip(likes, places)]
        if not any(type(t) is DeviceGroup for t in tensors):
            return views
        out, k = [], 0
        for t in tensors:  # (a group's views as one list)
            n = len(t.parts) if type(t) is DeviceGroup else 0
            out.append(views[k:k + n] if n else views[k])
            k += n or 1
        return out

    # -- the IPC path ----------------------------------------------------------------------------------
    def allreduce(self, reqs, scale: Optional[float], divide: int) -> list:
        """Allreduce a bucket (same dtype, op, scales) through the windows; results in request
        order; None when the windows cannot be opened (the caller stages through the host)."""
        b, first = self.backend, reqs[0]
        dtype = first.array.dtype
        size = dtype.itemsize
        offs = fusion.offsets([r.array for r in reqs])
        total = offs[-1]
        if not self._ensure_window(total * size):
            return None
        mine, peers = self._next_window()
        tensors = [r.array for r in reqs]
        b.wait_inputs([p for t in tensors for p in t.parts])
        b.gather(mine, first.array.pieces(0) if len(reqs) == 1 else  # (a group's: an array already)
                 np.array([piece for t, off in zip(tensors, offs) for piece in t.pieces(off * size)], np.uint64))
        seq = self.rt._next_seq()
        self._sync(seq, 0)
        n, me = self.rt.size, self.rt.rank
        how = (dtype, first.op, first.prescale, scale, divide, first.postscale)
        if self.hier is not None:
            out = self._across_hosts(first, total, mine, peers, seq, scale)
        elif n == 2 or total * size <= ONE_SHOT_BYTES:  # one shot
            out = b.alloc(total * size)
            b.reduce(peers, [out.ptr], total, *how)
        else:  # two shots
            out = b.alloc(total * size)
            edges = collectives._shm_bounds(total, n, dtype)
            lo = edges[me] * size
            b.reduce([p + lo for p in peers], [out.ptr + lo, mine + lo], edges[me + 1] - edges[me], *how)
            self._sync(seq, 1)
            b.gather(out.ptr, [(peers[q] + edges[q] * size, edges[q] * size, (edges[q + 1] - edges[q]) * size)
                               for q in range(n) if q != me])
        results = self._results(tensors, offs, out)  # (views made while the last kernels run)
        b.synchronize()
        return results

    def _across_hosts(self, first, total: int, mine: int, peers: List[int], seq: int, scale: Optional[float]):
        """The hierarchical allreduce of a bucket already packed into this host's windows: the
        bucket's parts (:class:`sdp.engine.groups.Hierarchy`) are each reduced on the device by
        their owner on this host, from every local window into its own; copied to host memory
        (only this rank's parts: 1/local size of the bucket crosses the bus); allreduced with the
        part's owners on the other hosts (the host algorithms, over ZeroMQ); copied back into the
        owner's window.  After a host barrier every rank gathers all parts from their owners'
        windows into a new allocation (returned).  16-bit sums of an average are scaled on the
        device before they are rounded, as the host hierarchy does; integer averages are divided
        (and post-scaled) on the host after the cross-host sum."""
        b, hier, dtype = self.backend, self.hier, first.array.dtype
        size = dtype.itemsize
        acc = accumulation_type(dtype)
        acc = None if acc == dtype else acc
        early = acc is not None and scale is not None and first.op in (ReduceOp.SUM, ReduceOp.AVERAGE)
        device_scale, cross_scale = (scale, None) if early else (None, scale)
        edges = collectives._shm_bounds(total, hier.nparts, dtype)
        host = b.host_buffer(total * size).view(dtype)
        for j in hier.parts:
            lo, hi = edges[j], edges[j + 1]
            if hi == lo:
                continue
            b.reduce([p + lo * size for p in peers], [mine + lo * size], hi - lo, dtype, first.op, first.prescale,
                     device_scale, 1, 1.0)
            part = host[lo:hi]
            b.to_host(part, mine + lo * size)
            collectives.allreduce(hier.cross[j], part, part, UFUNCS[first.op], seq, self.rt.config.segment_bytes,
                                  acc, cross_scale)
            self.rt._int_scale(part, first)
            b.to_device(mine + lo * size, part, wait=False)
        self._sync(seq, 1)
        out = b.alloc(total * size)
        b.gather(out.ptr, [(peers[hier.owner[j]] + edges[j] * size, edges[j] * size, (edges[j + 1] - edges[j]) * size)
                           for j in range(hier.nparts) if edges[j + 1] > edges[j]])
        return out

    def single(self, req, item, scale: Optional[float], divide: int):
        """Broadcast, allgather, alltoall or reducescatter of one device tensor through the windows;
        None when the windows cannot be opened (the caller stages through the host)."""
        if self.hier is not None:  # (across hosts: through host memory)
            return None
        b, a = self.backend, req.array
        n, me = self.rt.size, self.rt.rank
        row = int(np.prod(a.shape[1:], dtype=np.int64)) * a.dtype.itemsize  # bytes per first-dim row
        if req.kind == "allgather":
            dim0 = item["dim0"]
            need = max(dim0) * row
        elif req.kind == "alltoall":
            splits = item["splits"]
            need = max(sum(s) for s in splits) * row
        else:
            need = a.nbytes
        if not self._ensure_window(need):
            return None
        window, peers = self._next_window()
        b.wait_inputs([a])
        seq = self.rt._next_seq()
        if req.kind != "broadcast" or me == req.root:
            b.copy(window, a.ptr, a.nbytes)
        self._sync(seq, 0)
        if req.kind == "broadcast":
            out = b.alloc(a.nbytes)
            b.copy(out.ptr, peers[req.root], a.nbytes)
            result = self._result(a, a.dtype, a.shape, out)
        elif req.kind == "allgather":
            out = b.alloc(sum(dim0) * row)
            starts = np.concatenate([[0], np.cumsum(dim0)]) * row
            b.gather(out.ptr, [(peers[q], int(starts[q]), dim0[q] * row) for q in range(n)])
            result = self._result(a, a.dtype, (sum(dim0),) + a.shape[1:], out)
        elif req.kind == "alltoall":
            recv = [splits[q][me] for q in range(n)]
            out = b.alloc(max(1, sum(recv) * row))
            starts = np.concatenate([[0], np.cumsum(recv)]) * row
            pieces = [(peers[q] + sum(splits[q][:me]) * row, int(starts[q]), recv[q] * row) for q in range(n)]
            b.gather(out.ptr, pieces)
            result = (self._result(a, a.dtype, (sum(recv),) + a.shape[1:], out), np.asarray(recv, np.int32))
        else:  # reducescatter
            rows = collectives._bounds(a.shape[0], n)
            mine = rows[me + 1] - rows[me]
            out = b.alloc(max(1, mine * row))
            count = mine * row // a.dtype.itemsize
            b.reduce([p + rows[me] * row for p in peers], [out.ptr], count, a.dtype, req.op, req.prescale,
                     scale, divide, req.postscale)
            result = self._result(a, a.dtype, (mine,) + a.shape[1:], out)
        b.synchronize()
        return result

    # -- the fast lane's device allreduce (the calling thread) ------------------------------------------
    def lane_takes(self, req) -> bool:
        """Whether the fast lane may run allreduce ``req`` (of a :class:`DeviceTensor` or
        :class:`DeviceGroup`) in the calling thread: the IPC path on one host, with windows already
        open (the engine's first device collective opens them) that hold it, in one shot (2
        ranks, or at most :data:`ONE_SHOT_BYTES`: the lane has no barrier for a second)."""
        nbytes = req.array.nbytes
        return (self.ipc and self.hier is None and self.backend is not None and bool(self.windows)
                and nbytes <= self.windows[0].nbytes and (self.rt.size == 2 or nbytes <= ONE_SHOT_BYTES))

    def lane_pack(self, req) -> bool:
        """(Before the lane posts ``req``.)  Pack ``req``'s input into this rank's lane window of
        this turn and wait for the copy, so that a peer that sees the post may read it; False,
        with nothing done, while the engine thread runs device work or the windows changed."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            if not self.lane_takes(req):
                return False
            b, t = self.backend, req.array
            with b:
                b.wait_inputs(t.parts)
                b.gather(self.windows[WINDOWS + self._lane_turn].ptr, t.pieces(0))
                b.synchronize()
            return True
        finally:
            self.lock.release()

    def lane_reduce(self, req, scale: Optional[float], divide: int):
        """(The lane decided ``req``'s position FAST: every rank packed the same collective into
        its lane window of this turn.)  Reduce every rank's window, in rank order, into a new
        allocation (the engine's one-shot arithmetic, so the bits are the engine's), synchronised;
        returns the result as :meth:`allreduce` gives it.  The turn moves on for every rank alike:
        a rank packs a window again only after every peer posted its next position, which each
        does only after its read of this one finished."""
        with self.lock, self.backend:
            b, t = self.backend, req.array
            k = WINDOWS + self._lane_turn
            self._lane_turn = (self._lane_turn + 1) % LANE_WINDOWS
            self.lane_runs += 1
            out = b.alloc(t.nbytes)
            b.reduce(self.peers[k], [out.ptr], t.size, t.dtype, req.op, req.prescale, scale, divide, req.postscale)
            result = self._results([t], [0, t.size], out)[0]  # (views made while the kernel runs)
            b.synchronize()
        return result

    # -- the host-staged path ----------------------------------------------------------------------------
    def stage_in(self, req) -> None:
        """Replace ``req.array`` (a DeviceTensor) by a host copy; ``req.device`` keeps the tensor
        (a :class:`DeviceGroup`'s parts are copied to their places, padding zeroed)."""
        t = req.array
        host = self.rt._result_array(t.dtype, t.size).reshape(t.shape)  # page-locked shared memory if room
        if type(t) is DeviceGroup:
            self.backend.wait_inputs(t.parts)
            for p, start in zip(t.parts, t.starts):
                self.backend.to_host(host[start:start + p.size].view(np.uint8), p.ptr)
            fusion.zero_padding(host, t.parts, list(t.starts) + [t.size])
        else:
            self.backend.wait_inputs([t])
            self.backend.to_host(host.reshape(-1).view(np.uint8), t.ptr)
        req.device, req.array = t, host

    def allreduce_staged(self, req, out: np.ndarray, ufunc, seq: int, acc, scale: Optional[float]):
        """Allreduce device tensor ``req.array`` through this host's shared memory: its chunks
        are copied from the device straight into the segments (no host copy of the input), and
        each slab of the result (host ``out``, 1-D) goes back to a new device allocation as soon
        as it is final, while the next slab is reduced."""
        b, t = self.backend, req.array
        b.wait_inputs([t])
        size = t.dtype.itemsize
        dev = b.alloc(t.nbytes)

        def read(dst, lo, hi):
            b.to_host(dst, t.ptr + lo * size)

        def done(lo, hi):
            b.to_device(dev.ptr + lo * size, out[lo:hi], wait=False)

        collectives._shm_allreduce(self.mesh, t, out, ufunc, seq, acc, scale, read=read, done=done)
        b.synchronize()
        return self._result(t, t.dtype, t.shape, dev)

    def allreduce_wire(self, req, ufunc, seq: int, acc, scale: Optional[float]):
        """Allreduce device tensor ``req.array`` over the mesh (ranks on several hosts, one each)
        in a page-locked host buffer, pipelined: the ring copies each segment from the device just
        before it first sends it, and each segment of the result goes back to a new device
        allocation as soon as it is final, while the rest is in flight
        (:func:`collectives.allreduce`'s ``fill`` and ``done``)."""
        b, t = self.backend, req.array
        b.wait_inputs([t])
        size = t.dtype.itemsize
        host = b.host_buffer(t.nbytes).view(t.dtype)
        dev = b.alloc(t.nbytes)

        def fill(lo, hi):
            b.to_host(host[lo:hi], t.ptr + lo * size)

        def done(lo, hi):
            b.to_device(dev.ptr + lo * size, host[lo:hi], wait=False)

        collectives.allreduce(self.mesh, host, host, ufunc, seq, self.rt.config.segment_bytes, acc, scale, fill, done)
        b.synchronize()
        return self._result(t, t.dtype, t.shape, dev)

    def to_device(self, arr: np.ndarray) -> DeviceTensor:
        """A new device array holding a copy of host ``arr``."""
        arr = np.ascontiguousarray(arr)
        out = self.backend.alloc(arr.nbytes)
        self.backend.to_device(out.ptr, arr.reshape(-1).view(np.uint8))
        t = DeviceTensor(out.ptr, arr.shape, arr.dtype, self.backend.device_id, _Owner(out, self.backend))
        t.device_type = self.backend.device_type
        return t

    def stage_out(self, like: DeviceTensor, result):
        """A host result (array, or alltoall's tuple) as a new device array of ``like``'s kind."""
        if isinstance(result, tuple):
            return (self.stage_out(like, result[0]),) + tuple(result[1:])
        arr = np.ascontiguousarray(result)
        out = self.backend.alloc(arr.nbytes)
        self.backend.to_device(out.ptr, arr.reshape(-1).view(np.uint8))
        if type(like) is DeviceGroup:
            return self._results([like], [0, like.size], out)[0]
        return self._result(like, arr.dtype, arr.shape, out)

    def close(self) -> None:
        """Drop the windows and the backend's resources (in the backend's context)."""
        if self.backend is None:
            return
        with self.backend:
            if self._pinned is not None:
                self._pinned.release()
            self._opened, self.windows, self.peers, self._pinned = [], [], [], None
            self.backend.close()


class _Owner:
    """Keeps a result's allocation alive; ``to_gpuarray`` makes a PyCUDA ``GPUArray`` of it.  The
    last reference may go in any thread (a consumer's DLPack deleter): the allocation is handed
    back to the backend, which frees it in the engine thread (:meth:`Backend.retire`)."""

    def __init__(self, alloc: Allocation, backend):
        self.alloc, self.backend = alloc, backend

    def to_gpuarray(self, tensor: DeviceTensor):
        from pycuda import driver, gpuarray

        class Pointer(driver.PointerHolderBase):  # gpudata that owns its memory
            def __init__(self, ptr, owner):
                super().__init__()
                self.ptr, self.owner = ptr, owner

            def get_pointer(self):
                return self.ptr

        return gpuarray.GPUArray(tensor.shape, tensor.dtype, gpudata=Pointer(tensor.ptr, self))

    def __del__(self):
        try:
            self.backend.retire(self.alloc)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

