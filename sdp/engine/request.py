"""One tensor submitted to one collective: what the engine negotiates, fuses and runs (its
``meta`` is what every rank must agree on, see :mod:`sdp.engine.coordinator`), and the handle
its caller waits on."""
from typing import List, Optional

import numpy as np

from sdp.common.reduce_ops import ReduceOp, check_dtype
from sdp.engine import fusion
from sdp.engine.coordinator import KINDS
from sdp.engine.device_arrays import DeviceGroup, DeviceTensor
from sdp.engine.handles import Handle


class Request:
    """One tensor submitted to one collective (see ``sdp.engine.coordinator`` for ``meta``)."""

    __slots__ = ("name", "kind", "array", "op", "root", "prescale", "postscale", "splits", "handle", "out", "ps",
                 "device", "layout", "_shapes", "sources")

    @classmethod
    def group(cls, name: str, arrays: List[np.ndarray], layout: Optional[fusion.Layout] = None, **kw) -> "Request":
        """One allreduce request for several host arrays of one dtype (a *flattened group*),
        negotiated, cached and reduced as one tensor, so a group costs the engine one request
        instead of one per array.  ``layout``: the arrays' ``Layout``
        (made here if not given).  The arrays are packed once, where they go: into the fast
        lane's shared memory (``pack_into``), else into the request's own aligned buffer
        when the engine takes it (``fill``, the copy fusion would make anyway); they must
        not change until the result is there (as for any asynchronous collective).  Every rank
        must group the same shapes in the same order: the shapes are part of the agreed meta
        (``gs``).  The result is the list of the arrays' results (views of one buffer);
        ``PartHandle`` gives each.  Device tensors (``DeviceTensor`` objects of one dtype,
        device and kind) make a ``DeviceGroup`` instead, gathered into the device path's
        window when the engine runs it; its result is the list of the parts' results as their
        kind (views of one device allocation where the kind allows)."""
        layout = layout or fusion.Layout(arrays)
        if type(arrays[0]) is not np.ndarray:  # device tensors: packed by the device path's gather
            return cls(name, "allreduce", DeviceGroup(arrays, layout.starts, layout.count), layout=layout, **kw)
        req = cls(name, "allreduce", fusion.aligned_empty(layout.dtype, layout.count), layout=layout, **kw)
        req.sources = arrays
        return req

    @classmethod
    def burst(cls, name: str, array: np.ndarray, op, postscale: float) -> "Request":
        """What ``cls(name, "allreduce", array, op, postscale=postscale)`` makes, without its
        checks: for an array the fast lane's open batch takes (``Lane.burst``: a C-contiguous
        host array of the batch's dtype, op and postscale, which its first request passed)."""
        req = object.__new__(cls)
        req.name, req.kind, req.array, req.op, req.root, req.prescale = name, "allreduce", array, op, None, 1.0
        req.postscale, req.splits, req.out, req.ps, req.device, req.layout = postscale, None, None, 0, None, None
        req._shapes = req.sources = None
        req.handle = Handle(name)
        return req

    def fill(self) -> None:
        """Pack a flattened group's arrays into its buffer (``array``) if not done yet."""
        if self.sources is not None:
            self.layout.pack(self.sources, self.array)
            self.sources = None

    def pack_into(self, out: np.ndarray) -> None:
        """Copy the input into ``out`` (1-D, ``array.size`` elements of its dtype)."""
        if self.sources is not None:
            self.layout.pack(self.sources, out)
        else:
            np.copyto(out, self.array.reshape(-1))

    def __init__(self, name, kind, array, op=ReduceOp.SUM, root=None, prescale=1.0, postscale=1.0,
                 splits=None, out=None, ps=0, layout=None):
        if kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}")
        if not isinstance(name, str):
            raise TypeError(f"{kind}: name must be a str, got {type(name).__name__} {name!r}")
        #: the device array a request in device memory came as (``array`` is that array until the
        #: engine stages it through host memory; see sdp.engine.device_path)
        self.device = None if type(array) is np.ndarray or not isinstance(array, DeviceTensor) else array
        if self.device is None:
            if type(array) is not np.ndarray:
                array = np.asarray(array)
            if not array.flags.c_contiguous:
                array = np.ascontiguousarray(array)  # (ascontiguousarray would turn 0-d into 1-d)
        elif out is not None:
            raise ValueError(f"out= for '{name}': not supported for device arrays")
        self.name, self.kind, self.array = name, kind, array
        self.op, self.root, self.splits = op, root, splits
        self.prescale = prescale if type(prescale) is float else float(prescale)
        self.postscale = postscale if type(postscale) is float else float(postscale)
        check_dtype(kind, name, array.dtype, op, self.prescale, self.postscale)
        if kind == "reducescatter" and array.ndim == 0:
            raise ValueError(f"reducescatter of '{name}': needs at least one dimension to scatter, got a scalar")
        if out is not None and (kind != "allreduce" or out.shape != array.shape or out.dtype != array.dtype
                                or not out.flags.c_contiguous or not out.flags.writeable):
            raise ValueError(f"out= for '{name}' must be a writable C-contiguous {array.dtype} array of shape "
                             f"{array.shape} (allreduce only), got {out.dtype} {out.shape}")
        self.out = out
        self.ps = ps  # process set id (0: all ranks; see sdp.engine.process_sets)
        #: a flattened group's ``Layout`` (see ``group``), else None
        self.layout = layout
        self._shapes = None if layout is None else layout.shapes
        self.sources = None  # a flattened group's arrays until packed into ``array`` (see group)
        self.handle = Handle(name)

    def key(self) -> tuple:
        """Everything that must agree across ranks, hashable: the response-cache key."""
        return (self.name, self.kind, self.array.dtype, self.array.shape, self.op, self.root,
                self.prescale, self.postscale, None if self.splits is None else tuple(self.splits), self.ps,
                self.device is not None, self._shapes)

    def meta(self) -> dict:
        reduces = self.kind in ("allreduce", "reducescatter")
        ps = {"ps": self.ps} if self.ps else {}
        if self.device is not None:
            ps["dev"] = 1  # device memory: every rank must agree (the paths differ)
        if self._shapes is not None:
            ps["gs"] = [list(shape) for shape in self._shapes]  # a flattened group's shapes
        return {**ps, "n": self.name, "k": self.kind, "d": self.array.dtype.str if self.array.dtype.kind != "V"
                else self.array.dtype.name, "s": list(self.array.shape),
                "o": int(self.op) if reduces else None, "r": self.root,
                "pre": self.prescale, "post": self.postscale,
                "sp": None if self.splits is None else [int(x) for x in self.splits]}
