"""How the engine thread runs what rank 0 decided: an allreduce bucket (fused into one buffer,
device memory on the IPC path or staged, a process set's, Adasum's) and a single collective
(broadcast, allgather, alltoall, reducescatter).  A mixin of :class:`sdp.engine.runtime.Runtime`,
whose engine thread alone calls it; it uses the runtime's ``mesh``, ``config``, ``hierarchy``,
``size``, ``timeline``, ``_device``, ``_set_comms``, ``_complete``, ``_result_array``,
``_next_seq`` and ``_timeline_mark``."""
import functools
from typing import List, Optional

import numpy as np

from sdp.common import errors
from sdp.common.reduce_ops import UFUNCS, ReduceOp, accumulation_dtype, scale_in_place
from sdp.engine import adasum, collectives, fusion, groups, process_sets, timeline
from sdp.engine.device_arrays import DeviceGroup, DeviceTensor
from sdp.engine.request import Request


class Execution:
    """The engine thread's runners of negotiated collectives (see the module docstring)."""

    def _reduce(self, inp: np.ndarray, out: np.ndarray, req: Request, fill=None) -> None:
        """Prescale, allreduce ``inp`` into ``out`` (1-D; may be the same array), then
        postscale/average.  ``inp`` is left unchanged unless it is ``out``.  ``fill``: packs
        (and prescales) ``out`` on demand, see ``collectives.allreduce``."""
        seq = self._next_seq()
        if req.prescale != 1.0 and fill is None:
            if inp is not out:
                np.copyto(out, inp)
                inp = out
            self._prescale(inp, req)
        args = (UFUNCS[req.op], seq, self.config.segment_bytes, accumulation_dtype(out.dtype),
                self._float_scale(req, out.dtype))
        if self.hierarchy is None:
            collectives.allreduce(self.mesh, inp, out, *args, fill)
        else:
            if fill is not None:
                fill(0, out.size)
            collectives.allreduce_hierarchical(self.hierarchy, inp, out, *args)
        self._int_scale(out, req)

    @staticmethod
    def _prescale(buf: np.ndarray, req: Request) -> None:
        scale_in_place(buf, req.prescale)

    def _float_scale(self, req: Request, dtype: np.dtype) -> Optional[float]:
        """The factor (postscale, / size for AVERAGE) for float results, applied inside the
        collective (in float32 for 16-bit floats, before rounding); None when there is none."""
        if dtype.kind in "iub":
            return None
        factor = req.postscale / (self.size if req.op == ReduceOp.AVERAGE else 1)
        return None if factor == 1.0 else factor

    def _int_scale(self, buf: np.ndarray, req: Request) -> None:
        """Integer results: AVERAGE floor-divides by size; postscale multiplies (truncating)."""
        if buf.dtype.kind not in "iub":
            return
        if req.op == ReduceOp.AVERAGE:
            np.floor_divide(buf, self.size, out=buf)
        if req.postscale != 1.0:
            np.multiply(buf, req.postscale, out=buf, casting="unsafe")

    def _device_args(self, req: Request) -> tuple:
        """``(float scale, integer divisor)`` of a device reduction (see sdp.engine.backends)."""
        return (self._float_scale(req, req.array.dtype),
                self.size if req.op == ReduceOp.AVERAGE and req.array.dtype.kind in "iu" else 1)

    def _staged_directly(self, reqs: List[Request]) -> Optional[list]:
        """A lone device tensor's allreduce staged between the device and host memory piece by
        piece: through shared memory slab by slab (no host copy of the input), else over the
        mesh (ranks on several hosts, one each) segment by segment as the ring sends them; results
        copied back as they are final.  None where that route does not apply (the caller stages
        the input first)."""
        req = reqs[0]
        t = req.array
        if (len(reqs) > 1 or type(t) is DeviceGroup or req.ps or req.out is not None or self.hierarchy is not None
                or req.prescale != 1.0
                or t.dtype.kind != "f" and (req.op == ReduceOp.AVERAGE or req.postscale != 1.0)
                or self.size == 1):
            return None
        args = (UFUNCS[req.op], self._next_seq(), accumulation_dtype(t.dtype), self._float_scale(req, t.dtype))
        if not collectives.uses_shm(self.mesh, t.nbytes, t.size):
            return [self._device.allreduce_wire(req, *args)]
        return [self._device.allreduce_staged(req, self._result_array(t.dtype, t.size), *args)]

    def _allreduce_bucket(self, reqs: List[Request]) -> None:
        """One collective for ``reqs`` (same dtype/op/scales).  A fused bucket's fusion buffer is
        one new result array (see ``_result_array``): the bucket is packed straight into this
        rank's shared-memory half when it fits and reduced into the result, else packed into the
        result and reduced in place; each request gets a view of its part (no unpack copy).
        Device arrays take the device path's IPC route (``sdp.engine.device_path``)."""
        tl, names, first = self.timeline, [r.name for r in reqs], reqs[0]
        if tl:
            for name in names:
                tl.end(name, "QUEUE")
        if first.op == ReduceOp.ADASUM:
            return self._adasum_bucket(reqs)
        if isinstance(first.array, DeviceTensor):
            with timeline.span(tl, names, "ALLREDUCE"):
                results = (self._device.allreduce(reqs, *self._device_args(first))
                           if self._device.uses_ipc(first.ps) else self._staged_directly(reqs))
            if results is not None:
                for r, res in zip(reqs, results):
                    self._complete(r, res, staged=False)
                return
            for r in reqs:  # through host memory (for good, if the windows could not be opened)
                self._device.stage_in(r)
        dtype = first.array.dtype
        if first.ps:
            with timeline.span(tl, names, "ALLREDUCE"):
                results = process_sets.allreduce_bucket(self._set_comms[first.ps], reqs, self.config.segment_bytes,
                                                        accumulation_dtype)
            for r, res in zip(reqs, results):
                self._complete(r, res)
            return
        if len(reqs) == 1:
            out = first.out
            if out is None:
                out = self._result_array(dtype, first.array.size).reshape(first.array.shape)
            with timeline.span(tl, names, "ALLREDUCE"):
                self._reduce(first.array.reshape(-1), out.reshape(-1), first)
            self._complete(first, out)
            return
        arrays = [r.array for r in reqs]
        offs = fusion.offsets(arrays)
        total = offs[-1]
        result = self._result_array(dtype, total)
        if (collectives.uses_shm(self.mesh, total * dtype.itemsize, total)
                and total * dtype.itemsize <= self.mesh.shm.slab_bytes and first.prescale == 1.0):
            # packed straight into shared memory as the collective goes (all but this rank's own
            # chunk, which is reduced from the arrays themselves)
            def pack(dst, ranges):
                with timeline.span(tl, names, "FUSE"):
                    fusion.pack(dst, arrays, offs, ranges)

            with timeline.span(tl, names, "ALLREDUCE"):
                collectives.allreduce_staged(self.mesh, total, pack, functools.partial(fusion.pieces, arrays, offs),
                                             result, UFUNCS[first.op], self._next_seq(),
                                             accumulation_dtype(dtype), self._float_scale(first, dtype))
                self._int_scale(result, first)
        else:  # packed into the result array itself as the ring sends it, reduced in place
            fusion.zero_padding(result, arrays, offs)

            def fill(lo, hi):
                with timeline.span(tl, [names[i] for i in range(len(reqs)) if offs[i] < hi and offs[i + 1] > lo]
                                   if tl else (), "FUSE"):
                    fusion.pack(result, arrays, offs, [(lo, hi)])
                    self._prescale(result[lo:hi], first)

            with timeline.span(tl, names, "ALLREDUCE"):
                self._reduce(result, result, first, fill)
        with timeline.span(tl, names, "UNPACK"):
            for i, r in enumerate(reqs):
                view = result[offs[i]:offs[i] + r.array.size].reshape(r.array.shape)
                if r.out is not None:
                    np.copyto(r.out, view)
                    view = r.out
                self._complete(r, view)

    def check_adasum(self, ps: int) -> None:
        """Raise Horovod's ``NotImplementedError`` where an Adasum allreduce of process set ``ps``
        cannot run in this job (``sdp.engine.adasum.check``), at once, on the calling rank."""
        adasum.check(self.size, ps, self._adasum_hosts())

    def _adasum_hosts(self) -> Optional[List[List[int]]]:
        """The ranks of every host where Adasum runs hierarchically (SDP_HIERARCHICAL=1 and the
        engine's hierarchy: several hosts, one with several ranks), else None (over all ranks)."""
        return self.hierarchy.members if self.hierarchy is not None and self.config.hierarchical else None

    def _adasum_bucket(self, reqs: List[Request]) -> None:
        """One Adasum for the requests of a fusion bucket (``sdp.engine.adasum``): packed into
        one new array (device arrays staged through host memory first: Adasum is not elementwise,
        the device path's kernels are), prescaled, combined per tensor, postscaled; each request
        gets a view of its part."""
        tl, names, first = self.timeline, [r.name for r in reqs], reqs[0]
        if isinstance(first.array, DeviceTensor):
            for r in reqs:
                self._device.stage_in(r)
        arrays = [r.array for r in reqs]
        offs = fusion.offsets(arrays)
        result = fusion.aligned_empty(first.array.dtype, offs[-1])
        fusion.pack(result, arrays, offs)
        scale_in_place(result, first.prescale)
        starts = adasum.tensor_starts([r.layout for r in reqs], offs)
        with timeline.span(tl, names, "ADASUM"):
            hosts = self._adasum_hosts()
            if hosts is None:
                adasum.allreduce(self.mesh, result, starts, self._next_seq(), self.config.segment_bytes)
            else:
                leaders = None
                if self.hierarchy.host.rank == 0:
                    leaders = groups.Group(self.mesh, [m[0] for m in hosts], self.hierarchy.nparts + 2)
                adasum.hierarchical(self.hierarchy, leaders, result, starts,
                                    [self._next_seq() for _ in range(3)], self.config.segment_bytes)
        scale_in_place(result, first.postscale)
        for r, off in zip(reqs, offs):
            view = result[off:off + r.array.size].reshape(r.array.shape)
            if r.out is not None:
                np.copyto(r.out, view)
                view = r.out
            self._complete(r, view)

    def _run_single(self, req: Request, item: dict) -> None:
        self._timeline_mark(req.name, "QUEUE", None)
        with timeline.span(self.timeline, [req.name], req.kind.upper()):
            if req.ps:
                self._complete(req, process_sets.single_result(self._set_comms[req.ps], req, item,
                                                               self.config.segment_bytes, accumulation_dtype))
                return
            if isinstance(req.array, DeviceTensor):
                result = self._device.single(req, item, *self._device_args(req))
                if result is not None:
                    return self._complete(req, result, staged=False)
                self._device.stage_in(req)
            self._complete(req, self._single_result(req, item))

    def _single_result(self, req: Request, item: dict):
        seq, seg = self._next_seq(), self.config.segment_bytes
        a = req.array
        if req.kind == "broadcast":
            out = fusion.aligned_empty(a.dtype, a.size)  # aligned: sdp.tensorflow wraps it without a copy
            np.copyto(out, a.reshape(-1))
            collectives.broadcast(self.mesh, out, req.root, seq, seg)
            result = out.reshape(a.shape)
        elif req.kind == "allgather":
            row = int(np.prod(a.shape[1:], dtype=np.int64))
            dim0 = item["dim0"]
            edges = np.concatenate([[0], np.cumsum(dim0)]) * row
            flat = fusion.aligned_empty(a.dtype, sum(dim0) * row)
            out = flat.reshape((sum(dim0),) + a.shape[1:])
            flat[edges[self.rank]:edges[self.rank + 1]] = a.reshape(-1)
            if self.hierarchy is None:
                collectives.allgatherv(self.mesh, flat, [int(e) for e in edges], seq, seg)
            else:
                collectives.allgatherv_hierarchical(self.hierarchy, flat, [int(e) for e in edges], seq, seg)
            result = out
        elif req.kind == "alltoall":
            row = int(np.prod(a.shape[1:], dtype=np.int64))
            splits = item["splits"]  # splits[i][j]: rows rank i sends to rank j
            send_edges = [int(e) * row for e in np.concatenate([[0], np.cumsum(splits[self.rank])])]
            recv_rows = [splits[j][self.rank] for j in range(self.size)]
            recv_edges = [int(e) * row for e in np.concatenate([[0], np.cumsum(recv_rows)])]
            out = np.empty((sum(recv_rows),) + a.shape[1:], dtype=a.dtype)
            collectives.alltoallv(self.mesh, a.reshape(-1), send_edges, out.reshape(-1), recv_edges, seq, seg)
            result = (out, np.asarray(recv_rows, dtype=np.int32))
        elif req.kind == "reducescatter":
            row = int(np.prod(a.shape[1:], dtype=np.int64))
            rows = collectives._bounds(a.shape[0] if a.ndim else 0, self.size)
            edges = [e * row for e in rows]
            buf = a.copy().reshape(-1)
            scale_in_place(buf, req.prescale)
            collectives.reducescatter(self.mesh, buf, UFUNCS[req.op], seq, seg, edges,
                                      accumulation_dtype(buf.dtype), self._float_scale(req, buf.dtype))
            mine = buf[edges[self.rank]:edges[self.rank + 1]]
            self._int_scale(mine, req)
            result = mine.reshape((rows[self.rank + 1] - rows[self.rank],) + a.shape[1:]).copy()
        else:  # pragma: no cover - Request validates kinds
            raise errors.ProtocolError(f"unknown kind {req.kind}")
        return result
