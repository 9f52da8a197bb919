"""One entry per collective kind, and the ordered table of paths behind it (issue 55).

Faces call :mod:`sdp.api`, which resolves names and process sets and calls one entry of the
runtime's :class:`Dispatch` per kind (``rt.dispatch``).  The entry walks that kind's table in
order, as Horovod's ``OperationManager`` walks its list of implementations: each :class:`Path`
says whether it can take the call now (:meth:`Path.takes`: cheap checks of the call and of the
runtime's state) and runs it (:meth:`Path.run`), which may still decline after looking (None:
nothing done, on to the next path).  The last path, the engine thread, takes everything.
Adding a path (a transport, an algorithm) is adding one entry to a table here.

======================================  ==========================================================
entry (``Dispatch.``)                   paths, in order
======================================  ==========================================================
``allreduce`` (waited)                  :class:`CompiledFront`, :class:`LaneNow`, :class:`LinkNow`,
                                        :class:`DeviceNow`, :class:`Engine`
``allreduce_async``                     :class:`Burst`, :class:`Engine`
``grouped_allreduce`` (waited)          :class:`CompiledGroup`, :class:`LaneGroup`,
                                        :class:`DeviceGroupNow`, :class:`EngineGroup`
``grouped_allreduce_async``             :class:`CompiledGroup`, :class:`LaneGroup`, :class:`EngineGroup`
``submit`` (every other kind)           :class:`Engine`
======================================  ==========================================================

Which path can take what is in each class's docstring and in DESIGN.md's table.  The first
path of ``allreduce`` (the compiled front) and of ``allreduce_async`` (the burst) is checked in
the entry itself before a :class:`Call` is made, so the common case costs one C call, as it did
before the table (a Call and a walk from the first path cost a burst's allreduces a quarter
more: benchmarks/README.md).
Whichever path runs a call, every rank gets the same bits (the paths reduce with the same
kernels in the same order: DESIGN.md, "Invariants").
"""
from typing import List, Optional, Sequence

import numpy as np

from sdp.common.reduce_ops import ReduceOp
from sdp.engine import grouped
from sdp.engine.device_arrays import DeviceTensor, device_tensor, host_array
from sdp.engine.handles import Handle
from sdp.engine.request import Request

_ADASUM = ReduceOp.ADASUM


def as_input(tensor):
    """``tensor`` as the engine takes it: a ``DeviceTensor`` for device memory (CUDA arrays:
    ``__cuda_array_interface__`` or DLPack), else a numpy array (a view where the producer allows)."""
    if type(tensor) is np.ndarray:  # (the common case, ~0.3 us instead of ~1.2 per tensor)
        return tensor
    return device_tensor(tensor) or host_array(tensor)


class Call:
    """One allreduce call as the paths see it: ``sdp.allreduce``'s arguments with the name and
    process set id resolved; ``request()`` is the engine's :class:`Request` of it, made once
    (the device path and the engine share it)."""

    __slots__ = ("name", "tensor", "op", "prescale", "postscale", "out", "ps", "_req")

    def __init__(self, name: str, tensor, op: ReduceOp, prescale, postscale, out, ps: int):
        self.name, self.tensor, self.op, self.prescale, self.postscale = name, tensor, op, prescale, postscale
        self.out, self.ps, self._req = out, ps, None

    def plain(self) -> bool:
        """A host numpy array of every rank, no prescale, an elementwise op: what the in-caller
        host paths take."""
        return (not self.ps and type(self.tensor) is np.ndarray and self.prescale == 1.0
                and self.op is not _ADASUM)

    def post(self) -> float:
        """``postscale`` as a float (what the in-caller paths take)."""
        return self.postscale if type(self.postscale) is float else float(self.postscale)

    def request(self) -> Request:
        if self._req is None:
            self._req = Request(self.name, "allreduce", as_input(self.tensor), self.op, None, self.prescale,
                                self.postscale, None, self.out, self.ps)
        return self._req


class Path:
    """One way to run a collective.  ``takes(call)``: can it take ``call`` now (nothing done);
    ``run(call)``: the result (or handle, for an asynchronous entry), or None where it declines
    after looking (nothing posted: the next path runs the call).  ``rt``: the :class:`Runtime`,
    whose attributes (``front``, ``lane``, ``link``, ...) are read at each call: they turn to
    None once the runtime stops or fails."""

    name = "path"

    def __init__(self, rt):
        self.rt = rt

    def takes(self, call) -> bool:
        raise NotImplementedError

    def run(self, call):
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


# -- allreduce: single arrays -------------------------------------------------------------------
class CompiledFront(Path):
    """The fast lane's compiled step (one host) or the host leaders' compiled step (across hosts,
    :class:`sdp.engine.hostlink.LinkFront`): an allreduce of a name it has learnt, run whole in C
    in the caller (``rt.front``)."""

    name = "compiled front"

    def takes(self, call: Call) -> bool:
        return self.rt.front is not None and call.plain()

    def run(self, call: Call):
        front = self.rt.front
        return None if front is None else front(call.name, call.tensor, call.op, call.postscale, call.out)


class LaneNow(Path):
    """The fast lane in Python, in the caller (every rank on this host, the lane idle:
    :meth:`sdp.engine.lane.Lane.allreduce_now`); it teaches the compiled front what it ran."""

    name = "lane in caller"

    def takes(self, call: Call) -> bool:
        return self.rt.lane is not None and call.plain() and self.rt.usable()

    def run(self, call: Call):
        lane = self.rt.lane
        return None if lane is None else lane.allreduce_now(call.name, call.tensor, call.op, call.post(), call.out)


class LinkNow(Path):
    """The host leaders' link in the caller (ranks on several hosts, :mod:`sdp.engine.hostlink`).
    Every waited allreduce of every rank posts a position on the link, so that the leaders stay
    in step: a plain one runs there; any other is posted as a skip and goes on to the engine."""

    name = "link in caller"

    def takes(self, call: Call) -> bool:
        return self.rt.link is not None and not call.ps

    def run(self, call: Call):
        link = self.rt.link
        if link is None:
            return None
        if call.plain():
            if not self.rt.usable():
                return None
            return link.allreduce_now(call.name, call.tensor, call.op, call.post(), call.out)
        link.skip()
        return None


class DeviceNow(Path):
    """Device memory through the fast lane and the device path's own windows, in the caller
    (one host, every rank, no prescale, an elementwise op; not before the engine ran the first
    device collective, which opens the windows: :meth:`Runtime.device_now`)."""

    name = "device in caller"

    def takes(self, call: Call) -> bool:
        return (self.rt.lane is not None and not call.ps and call.prescale == 1.0 and call.op is not _ADASUM
                and type(call.tensor) is not np.ndarray and call.request().device is not None)

    def run(self, call: Call):
        return self.rt.device_now(call.request())


class Engine(Path):
    """The engine thread: negotiated by rank 0, fused, run over shared memory and ZeroMQ
    (:meth:`Runtime.submit`; the fast lane keeps what it may run of a submission, see
    :meth:`sdp.engine.lane.Lane.post`).  Takes everything; Adasum's checks are made here."""

    name = "engine"

    def takes(self, call: Call) -> bool:
        return True

    def run(self, call: Call) -> Handle:
        if call.op is _ADASUM:
            self.rt.check_adasum(call.ps)
        return self.rt.submit(call.request())


class Burst(Path):
    """The fast lane's open batch (``rt.burst``): a burst of small asynchronous allreduces, one
    host, joins it in C (:meth:`sdp.engine.lane.Lane.burst_front`)."""

    name = "lane burst"

    def takes(self, call: Call) -> bool:
        return (self.rt.burst is not None and not call.ps and call.out is None and call.prescale == 1.0
                and call.op is not _ADASUM)

    def run(self, call: Call) -> Optional[Handle]:
        burst = self.rt.burst
        return None if burst is None else burst(call.name, call.tensor, call.op, call.postscale)


# -- grouped allreduce ----------------------------------------------------------------------------
class GroupCall:
    """One grouped allreduce as the paths see it: names resolved (``<name>@ps<id>`` in a process
    set), ``wait``: the waited entry (results) or the asynchronous one (handles), ``threshold``:
    the fusion threshold (bytes).  ``plan()``: :func:`sdp.engine.grouped.plan_for` of the
    arrays, computed once."""

    __slots__ = ("names", "arrays", "op", "prescale", "postscale", "ps", "wait", "threshold", "_plan")

    def __init__(self, names: List[str], arrays: list, op: ReduceOp, prescale, postscale, ps: int, wait: bool,
                 threshold: int):
        self.names, self.arrays, self.op, self.prescale, self.postscale = names, arrays, op, prescale, postscale
        self.ps, self.wait, self.threshold, self._plan = ps, wait, threshold, None

    def plan(self) -> grouped.Planned:
        if self._plan is None:
            self._plan = grouped.plan_for(self.names, self.arrays, self.threshold)
        return self._plan


def _whole(call: GroupCall) -> Optional[tuple]:
    """The plan's one group of every array, of every rank with no prescale, where there is one:
    ``(group name, layout)``, else None."""
    p = call.plan().plan
    if call.ps or call.prescale != 1.0 or call.op is _ADASUM or p is None or len(p) != 1 or p[0][2] is None:
        return None
    return p[0][1], p[0][2]


class CompiledGroup(Path):
    """The compiled group entry (``rt.front_group``, one host): a group it has learnt (names,
    dtypes and shapes), run whole in C in the caller; asynchronous: held while peers are late."""

    name = "compiled group"

    def takes(self, call: GroupCall) -> bool:
        return self.rt.front_group is not None and not call.ps and call.prescale == 1.0 and call.op is not _ADASUM

    def run(self, call: GroupCall):
        front = self.rt.front_group
        if front is None:
            return None
        got = front(call.names, call.arrays, call.op, call.postscale, self.rt.fusion_threshold, not call.wait)
        return got if got is None or call.wait else grouped.part_handles(call.names, got)


class LaneGroup(Path):
    """One flattened host group of every array through the fast lane in the caller
    (:meth:`sdp.engine.lane.Lane.allreduce_now` with a layout), which then teaches the compiled
    group entry the group (:meth:`sdp.engine.lane.Lane.learn_group`)."""

    name = "lane group"

    def takes(self, call: GroupCall) -> bool:
        if self.rt.lane is None or not self.rt.usable():
            return False
        whole = _whole(call)
        return whole is not None and type(call.plan().arrays[0]) is np.ndarray

    def run(self, call: GroupCall):
        rt, planned = self.rt, call.plan()
        group, layout = _whole(call)
        result = rt.lane.allreduce_now(group, planned.arrays, call.op, float(call.postscale), None, layout,
                                       not call.wait)
        if result is None:
            return None
        if rt.front_group is not None and planned.learnt:  # (its next calls: whole in the compiled entry)
            rt.lane.learn_group(call.names, rt.fusion_threshold, planned.metas, group, layout, call.op,
                                float(call.postscale))
        if call.wait:
            return result.wait() if type(result) is Handle else result
        return grouped.part_handles(call.names, result)


class DeviceGroupNow(Path):
    """One flattened device group of every array through the fast lane and the device path, in
    the caller (as :class:`DeviceNow`; waited calls only)."""

    name = "device group in caller"

    def takes(self, call: GroupCall) -> bool:
        return (call.wait and self.rt.lane is not None and _whole(call) is not None
                and isinstance(call.plan().arrays[0], DeviceTensor))

    def run(self, call: GroupCall):
        group, layout = _whole(call)
        req = Request.group(group, call.plan().arrays, layout, op=call.op, prescale=call.prescale,
                            postscale=call.postscale, ps=call.ps)
        result = self.rt.device_now(req)
        if result is not None:
            return result
        self.rt.submit_many([req])  # (declined with nothing posted: this request to the engine)
        return req.handle.wait()


class EngineGroup(Path):
    """The engine thread, one request per plan entry (:func:`sdp.engine.grouped.requests`):
    a flattened group per run of one dtype cut at the fusion threshold, large arrays one each."""

    name = "engine"

    def takes(self, call: GroupCall) -> bool:
        return True

    def run(self, call: GroupCall):
        if call.op is _ADASUM:
            self.rt.check_adasum(call.ps)
        reqs, handles = grouped.requests(call.plan(), call.names, call.op, call.prescale, call.postscale,
                                         call.ps, not call.wait)
        if reqs:
            self.rt.submit_many(reqs)
        if not call.wait:
            return handles
        if type(handles) is not list:  # (one group of every array: its result is the list)
            return handles.wait()
        return [h.wait() for h in handles]


class Dispatch:
    """The entries of one runtime, one per collective kind (see the module docstring), and
    their tables (``allreduce_paths`` & co., tuples of :class:`Path`, in order)."""

    def __init__(self, rt):
        self.rt = rt
        engine = Engine(rt)
        self.allreduce_paths = (CompiledFront(rt), LaneNow(rt), LinkNow(rt), DeviceNow(rt), engine)
        self.allreduce_async_paths = (Burst(rt), engine)
        engine_group = EngineGroup(rt)
        self.grouped_paths = (CompiledGroup(rt), LaneGroup(rt), DeviceGroupNow(rt), engine_group)
        self.grouped_async_paths = (CompiledGroup(rt), LaneGroup(rt), engine_group)
        self.submit_paths = (engine,)

    @staticmethod
    def _walk(paths, call):
        for path in paths:
            if path.takes(call):
                got = path.run(call)
                if got is not None:
                    return got
        raise AssertionError(f"no path took {call!r}")  # (the engine takes everything)

    def allreduce(self, name: str, tensor, op: ReduceOp, prescale, postscale, out, ps: int):
        """``sdp.allreduce``, waited: the result (``out`` where given; for device memory the
        input's kind; for host memory a numpy array)."""
        if not ps and type(tensor) is np.ndarray and prescale == 1.0 and op is not _ADASUM:
            front = self.rt.front  # (the first path, CompiledFront, checked here: no Call made)
            if front is not None:
                result = front(name, tensor, op, postscale, out)
                if result is not None:
                    return result
        got = self._walk(self.allreduce_paths[1:], Call(name, tensor, op, prescale, postscale, out, ps))
        return got.wait() if type(got) is Handle else got

    def allreduce_async(self, name: str, tensor, op: ReduceOp, prescale, postscale, out, ps: int) -> Handle:
        """``sdp.allreduce_async``: its handle."""
        if not ps and out is None and prescale == 1.0 and op is not _ADASUM:
            burst = self.rt.burst  # (the first path, Burst, checked here: no Call made)
            if burst is not None:
                handle = burst(name, tensor, op, postscale)
                if handle is not None:
                    return handle
        return self._walk(self.allreduce_async_paths[1:], Call(name, tensor, op, prescale, postscale, out, ps))

    def grouped_allreduce(self, names: List[str], arrays: Sequence, op: ReduceOp, prescale, postscale,
                          ps: int, wait: bool):
        """``sdp.grouped_allreduce`` (``wait``: the list of results) or its asynchronous form (one
        handle per array)."""
        call = GroupCall(names, arrays, op, prescale, postscale, ps, wait, self.rt.fusion_threshold)
        return self._walk(self.grouped_paths if wait else self.grouped_async_paths, call)

    def submit(self, req: Request) -> Handle:
        """Every other kind (allgather, broadcast, alltoall, reducescatter, join): the engine's."""
        return self.rt.submit(req)

    def submit_many(self, reqs: List[Request]) -> List[Handle]:
        """Several requests of another kind at once (``grouped_broadcast``): the engine's, in one
        message, so that they are scheduled and fused together."""
        return self.rt.submit_many(reqs)
