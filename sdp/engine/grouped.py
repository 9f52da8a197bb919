"""How a grouped allreduce goes to the engine: its *plan* (which arrays travel together as one
flattened group, :meth:`sdp.engine.request.Request.group`, and which alone), remembered per
names and fusion threshold because a training step makes the same groups every step, and the
requests and per-array handles of a plan.  Used by the grouped entries of
:mod:`sdp.engine.dispatch`."""
import zlib
from typing import List, NamedTuple, Optional

import numpy as np

from sdp.engine import fusion
from sdp.engine.device_arrays import DeviceTensor, device_tensors, host_array
from sdp.engine.handles import Handle, PartHandle
from sdp.engine.request import Request

#: bytes: host arrays of at most this mean size are grouped (one request per dtype run), larger
#: ones go one request each and the engine fuses them
GROUP_MEAN_BYTES = 64 << 10
_PLANS_MAX = 1024  # plans remembered
_plans = {}  # (names, fusion threshold) -> (metas, plan)


class Planned(NamedTuple):
    """A grouped allreduce's arrays as the engine takes them (``arrays``: numpy arrays or
    ``DeviceTensor`` objects), their ``metas`` (dtype and shape; for device tensors also device,
    kind and type) and ``plan`` (None: a request per array; else ``[(indices, group name,
    layout)]``, one entry per request, layout None for an array alone); ``learnt``: the plan is
    the one remembered for these names (the compiled group entry may learn it)."""
    arrays: list
    metas: Optional[list]
    plan: Optional[list]
    learnt: bool


def plan_for(names: List[str], tensors, threshold: int) -> Planned:
    """The plan of a grouped allreduce of ``tensors`` named ``names`` at fusion ``threshold``
    (bytes), remembered: a known group whose arrays still have their dtypes and shapes costs
    ~1 us for 100 arrays (compared in C where the compiled step is built)."""
    arrays = list(tensors)
    key = (tuple(names), threshold)
    known = _plans.get(key) if len(arrays) >= 2 else None
    step = fusion.compiled()
    if known is not None and step is not None and step.same_metas(arrays, known[0]):
        return Planned(arrays, known[0], known[1], True)
    metas = [(a.dtype, a.shape) for a in arrays if type(a) is np.ndarray]  # (one pass: the plan's key)
    if len(metas) < len(arrays):
        arrays = [t if t is not None else host_array(a) for a, t in zip(arrays, device_tensors(arrays))]
        metas = [(a.dtype, a.shape) for a in arrays if type(a) is np.ndarray]
    device = not metas and len(arrays) >= 2 and all(isinstance(a, DeviceTensor) for a in arrays)
    if device:  # (every array in device memory: groups of one dtype, device and kind)
        metas = [(a.dtype, a.shape, a.device_id, a.kind, type(a.source)) for a in arrays]
    if len(arrays) < 2 or len(metas) != len(arrays):
        return Planned(arrays, None, None, False)
    if known is not None and known[0] == metas:  # (a list compared: ~3x cheaper than hashed as a tuple)
        return Planned(arrays, metas, known[1], True)
    plan = _plan(names, arrays, threshold, [m[:1] + m[2:] for m in metas] if device else None)
    if len(_plans) >= _PLANS_MAX:
        _plans.clear()
    _plans[key] = (metas, plan)
    return Planned(arrays, metas, plan, True)


def _plan(names: List[str], arrays: list, threshold: int, device: Optional[list] = None) -> Optional[list]:
    """None (host arrays whose mean size is over ``GROUP_MEAN_BYTES``: a request each), else
    ``[(indices, group name, layout)]``: a run of one dtype cut at the fusion ``threshold``
    (layout None: one array alone).  ``device``: for ``DeviceTensor`` objects, what each array's
    group must share (dtype, device, kind), at any size: the device path gathers a group with
    one launch where a request each costs ~19 us of Python."""
    if device is None and sum(a.nbytes for a in arrays) > GROUP_MEAN_BYTES * len(arrays):
        return None
    by_dtype = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype if device is None else device[i], []).append(i)
    plan = []
    for same in by_dtype.values():
        for idx in fusion.runs(same, [arrays[i].nbytes for i in same], threshold):
            if len(idx) == 1:
                plan.append((idx, None, None))
                continue
            group = [names[i] for i in idx]
            digest = zlib.crc32("\0".join(group).encode())
            plan.append((idx, f"{group[0]} (+{len(idx) - 1}) #{digest:08x}",
                         fusion.Layout([arrays[i] for i in idx])))
    return plan


def part_handles(names: List[str], got) -> List[PartHandle]:
    """Each array's handle of a group run whole: ``got``, the group's ``Handle``, or the list
    of its results."""
    whole = got
    if type(got) is not Handle:
        whole = Handle(names[0])
        whole._set(result=got)
    step = fusion.compiled()
    return (step.part_handles(PartHandle, names, whole) if step is not None  # (~20 us less for 100)
            else [PartHandle(name, whole, j) for j, name in enumerate(names)])


def requests(planned: Planned, names: List[str], op, prescale, postscale, ps: int, parts: bool) -> tuple:
    """``(requests, handles)`` of a plan for the engine: one request per plan entry (per array
    without a plan); ``handles`` one per array, or, where not ``parts`` and every array went in
    one group, in order, that group's handle alone (its result is the list of the results)."""
    kw = dict(op=op, prescale=prescale, postscale=postscale, ps=ps)
    arrays, plan = planned.arrays, planned.plan
    if plan is None:
        reqs = [Request(n, "allreduce", a, **kw) for a, n in zip(arrays, names)]
        return reqs, [r.handle for r in reqs]
    handles, reqs = [None] * len(arrays), []
    for idx, group, layout in plan:
        if layout is None:
            reqs.append(Request(names[idx[0]], "allreduce", arrays[idx[0]], **kw))
            handles[idx[0]] = reqs[-1].handle
            continue
        reqs.append(Request.group(group, arrays if len(idx) == len(arrays) else [arrays[i] for i in idx],
                                  layout, **kw))
        whole = reqs[-1].handle
        if len(idx) == len(arrays):  # (one group of every array, in order)
            if not parts:
                return reqs, whole
            handles = part_handles(names, whole)
            continue
        for j, i in enumerate(idx):
            handles[i] = PartHandle(names[i], whole, j)
    return reqs, handles
