"""Device backends: the one interface the engine's device path (:mod:`sdp.engine.device_path`)
uses for memory it does not reach with numpy, and its numpy implementation.

A backend owns: allocations (:meth:`Backend.alloc` -> :class:`Allocation`, a pointer that stays
valid while the allocation lives), copies (device to device, device to host, host to device, and a
gather of many pieces in one launch), the reduction kernel (:meth:`Backend.reduce`: n sources, m
destinations, every op, pre/post-scale), stream synchronisation, and inter-process handles
(:meth:`Backend.ipc_export` / :meth:`Backend.ipc_open`).  Pointers are plain ints.

* :class:`NumpyBackend`: host memory; its exportable allocations are shared memory (0600 memfds
  on Linux, else ``/dev/shm`` files) that peers of the same host ``mmap``, so the device path's
  algorithms run (and are tested) on machines without a GPU.  Selected with ``SDP_DEVICE_BACKEND=numpy``.
* :class:`sdp.engine.cuda_backend.CudaBackend`: PyCUDA on the device's primary context, imported
  only when a device array reaches the engine.

The reduction's arithmetic, the same in every backend (the CUDA kernels are checked against
:func:`reduce_arrays` bit for bit):

* floats: every source is read in the accumulation type (float32 for float16/bfloat16/float32,
  float64 for float64); a prescale factor multiplies it there and the product is rounded to the
  tensor's dtype (as a prescaled buffer is stored); sources are combined in rank order; the
  result is multiplied by ``scale`` (postscale, / n for AVERAGE) in the accumulation type and
  rounded once.
* integers: prescale multiplies in float64 and truncates; sources combine with wrap-around; AVERAGE
  floor-divides by ``divide``; postscale multiplies in float64 and truncates.
* bool: SUM/MAX are logical or, MIN/PRODUCT logical and.
"""
import ctypes
import itertools
import logging
import os
import re
from typing import List, Optional, Sequence

import numpy as np

from sdp.common.reduce_ops import ReduceOp
from sdp.transport import shm

log = logging.getLogger("sdp.engine.device")


def accumulation_type(dtype: np.dtype) -> np.dtype:
    """The dtype a reduction of ``dtype`` computes in: float32 for 16-bit floats, else itself."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f" and dtype.itemsize == 2 or dtype.name == "bfloat16":
        return np.dtype(np.float32)
    return dtype


def _combine(op: ReduceOp, acc: np.ndarray, x: np.ndarray) -> None:
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        np.add(acc, x, out=acc)
    elif op == ReduceOp.MIN:
        np.minimum(acc, x, out=acc)
    elif op == ReduceOp.MAX:
        np.maximum(acc, x, out=acc)
    elif op == ReduceOp.PRODUCT:
        np.multiply(acc, x, out=acc)
    else:
        raise ValueError(f"reduce op {ReduceOp(op).name} is not supported on devices")


def bool_op(op: ReduceOp) -> ReduceOp:
    """A bool reduction as the uint8 one the kernels run: or = MAX, and = MIN."""
    return ReduceOp.MAX if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVERAGE) else ReduceOp.MIN


def reduce_arrays(srcs: Sequence[np.ndarray], op: ReduceOp, prescale: float = 1.0, scale: Optional[float] = None,
                  divide: int = 1, postscale: float = 1.0) -> np.ndarray:
    """The reference reduction of same-shape arrays ``srcs`` (rank order) -> a new array of their
    dtype.  ``scale``: the float result factor (postscale, / n for AVERAGE; None: 1); ``divide``
    and ``postscale``: the integer AVERAGE divisor and postscale.  See the module docstring."""
    dtype = srcs[0].dtype
    if dtype == np.bool_:
        acc = srcs[0].astype(np.uint8)
        for x in srcs[1:]:
            _combine(bool_op(op), acc, x.view(np.uint8))
        return acc.astype(np.bool_)
    if dtype.kind in "iu":
        def pre(x):
            return x.copy() if prescale == 1.0 else np.multiply(x, prescale, dtype=np.float64).astype(dtype)
        acc = pre(srcs[0])
        with np.errstate(over="ignore"):
            for x in srcs[1:]:
                _combine(op, acc, pre(x))
        if op == ReduceOp.AVERAGE and divide != 1:
            np.floor_divide(acc, divide, out=acc)
        if postscale != 1.0:
            acc = np.multiply(acc, postscale, dtype=np.float64).astype(dtype)
        return acc
    at = accumulation_type(dtype)

    def pre(x):
        v = x.astype(at)
        if prescale != 1.0:
            np.multiply(v, at.type(prescale), out=v)
            v = v.astype(dtype).astype(at)  # a prescaled value is stored in the tensor's dtype
        return v
    acc = pre(srcs[0])
    for x in srcs[1:]:
        _combine(op, acc, pre(x))
    if scale is not None and scale != 1.0:
        np.multiply(acc, at.type(scale), out=acc)
    return acc.astype(dtype)


class Allocation:
    """``nbytes`` bytes at ``ptr`` owned by ``owner`` (freed when the last reference goes)."""

    __slots__ = ("ptr", "nbytes", "owner", "__weakref__")

    def __init__(self, ptr: int, nbytes: int, owner):
        self.ptr, self.nbytes, self.owner = int(ptr), int(nbytes), owner


class Backend:
    """The interface (see the module docstring).  ``counters``: bytes moved per direction
    (``d2h``, ``h2d``, ``d2d``) and kernel launches, for tests and benchmarks."""

    name = "abstract"
    device_type = 0  # DLPack device type of its memory
    device_id = 0

    def __init__(self):
        self.counters = {"d2h": 0, "h2d": 0, "d2d": 0, "kernels": 0}

    def __enter__(self):  # make this backend's context current on the calling thread
        return self

    def __exit__(self, *exc):
        return False

    def alloc(self, nbytes: int, exportable: bool = False) -> Allocation:
        raise NotImplementedError

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Device to device, in stream order."""
        raise NotImplementedError

    def gather(self, dst: int, pieces) -> None:
        """Copy ``(src_ptr, dst_offset, nbytes)`` pieces (tuples, or the rows of an (n, 3) uint64
        array) into ``dst`` (one launch where it can)."""
        if type(pieces) is np.ndarray:
            pieces = pieces.tolist()
        for src, off, nbytes in pieces:
            self.copy(dst + off, src, nbytes)

    def to_host(self, dst: np.ndarray, src: int) -> None:
        raise NotImplementedError

    def to_device(self, dst: int, src: np.ndarray, wait: bool = True) -> None:
        """Host to device; ``wait=False``: in stream order, done by the next :meth:`synchronize`
        (``src`` must stay alive and unchanged until then)."""
        raise NotImplementedError

    def reduce(self, srcs: List[int], dsts: List[int], count: int, dtype, op: ReduceOp, prescale: float,
               scale: Optional[float], divide: int, postscale: float) -> None:
        """``count`` elements: combine ``srcs`` (pointers, rank order) and write the result to
        every pointer of ``dsts`` (see :func:`reduce_arrays` for the arithmetic)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Return once every operation issued so far has finished."""

    def wait_inputs(self, tensors) -> None:
        """Make the engine's work follow what the producers of ``tensors`` (DeviceTensors)
        issued on their streams (each stream waited on once)."""

    def ipc_export(self, alloc: Allocation) -> Optional[bytes]:
        return None

    def ipc_open(self, handle: bytes, nbytes: int) -> Allocation:
        raise NotImplementedError

    def ipc_unlink(self, alloc: Allocation) -> None:
        """Peers have opened ``alloc``: drop whatever name it was exported under."""

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """A host staging buffer (page-locked where the backend can) of at least ``nbytes``."""
        return np.empty(nbytes, np.uint8)

    def memory_info(self) -> str:
        return ""

    def pin(self, array: np.ndarray):
        """Page-lock ``array`` where the backend can (None: nothing to do)."""
        return None

    def retire(self, alloc: Allocation) -> None:
        """Free ``alloc`` (called from any thread, when its last user let go of it)."""

    def close(self) -> None:
        """Release what the backend holds (called in its context, after the last collective)."""


def _as_array(ptr: int, nbytes: int) -> np.ndarray:
    if nbytes == 0:
        return np.zeros(0, np.uint8)
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint8)), (nbytes,))


def _typed(ptr: int, dtype, count: int) -> np.ndarray:
    dtype = np.dtype(dtype)
    return _as_array(ptr, count * dtype.itemsize).view(dtype)


class _Mapped:
    """Shared memory a peer of this host can map: a memfd (0600) named to peers as
    ``/proc/<pid>/fd/<fd>`` where Linux has them (nothing is left behind however the job ends),
    else a ``/dev/shm`` file (as :mod:`sdp.transport.shm` makes its segments)."""

    def __init__(self, nbytes: int, path: Optional[str] = None):
        self.fd = None
        nbytes = max(nbytes, 1)
        if path is not None:
            self.array = shm._map(path, nbytes, create=False)
        elif shm._memfd_usable():
            self.fd, self.array = shm._create_memfd("sdp-dev", nbytes)
            path = f"/proc/{os.getpid()}/fd/{self.fd}"
        else:
            path = f"/dev/shm/sdp-dev-{os.getpid()}-{next(_ids)}"
            self.array = shm._map(path, nbytes, create=True)
        self.path = path

    def unlink(self) -> None:
        """Drop the name (peers have mapped it; the mappings stay)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        elif self.path.startswith("/dev/shm/"):
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


_ids = itertools.count()
_WINDOW_NAME = re.compile(r"^(/proc/[0-9]+/fd/[0-9]+|/dev/shm/sdp-dev-[0-9]+-[0-9]+)$")


class NumpyBackend(Backend):
    """Host memory standing in for a device (see the module docstring)."""

    name = "numpy"
    device_type = 1  # kDLCPU

    def alloc(self, nbytes: int, exportable: bool = False) -> Allocation:
        if exportable:
            m = _Mapped(nbytes)
            return Allocation(m.array.ctypes.data, nbytes, m)
        from sdp.engine.fusion import aligned_empty
        a = aligned_empty(np.uint8, max(nbytes, 1))
        return Allocation(a.ctypes.data, nbytes, a)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes:
            ctypes.memmove(dst, src, nbytes)
            self.counters["d2d"] += nbytes

    def to_host(self, dst: np.ndarray, src: int) -> None:
        if dst.nbytes:
            ctypes.memmove(dst.ctypes.data, src, dst.nbytes)
            self.counters["d2h"] += dst.nbytes

    def to_device(self, dst: int, src: np.ndarray, wait: bool = True) -> None:
        if src.nbytes:
            ctypes.memmove(dst, np.ascontiguousarray(src).ctypes.data, src.nbytes)
            self.counters["h2d"] += src.nbytes

    def reduce(self, srcs, dsts, count, dtype, op, prescale, scale, divide, postscale) -> None:
        if not count:
            return
        res = reduce_arrays([_typed(p, dtype, count) for p in srcs], op, prescale, scale, divide, postscale)
        for p in dsts:
            np.copyto(_typed(p, dtype, count), res)
        self.counters["kernels"] += 1

    def ipc_export(self, alloc: Allocation) -> Optional[bytes]:
        return alloc.owner.path.encode() if isinstance(alloc.owner, _Mapped) else None

    def ipc_open(self, handle: bytes, nbytes: int) -> Allocation:
        path = handle.decode()
        if not _WINDOW_NAME.match(path):
            raise ValueError(f"not a device window name: {path!r}")
        m = _Mapped(nbytes, path)
        return Allocation(m.array.ctypes.data, nbytes, m)

    def ipc_unlink(self, alloc: Allocation) -> None:
        if isinstance(alloc.owner, _Mapped):
            alloc.owner.unlink()
