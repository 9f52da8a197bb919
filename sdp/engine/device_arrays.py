"""Arrays in device (GPU) memory as the engine sees them, and the exchange formats they come in.

A collective's input is either host memory (numpy, anything ``np.asarray`` takes, a CPU DLPack
capsule) or device memory, recognised without importing any GPU library:

* a PyCUDA ``GPUArray`` (it has ``gpudata`` and ``__cuda_array_interface__``);
* any object with ``__cuda_array_interface__`` (version 2/3: CuPy, PyTorch, Numba, JAX), whose
  ``stream`` the engine waits on before it reads;
* any DLPack producer (``__dlpack__`` + ``__dlpack_device__``, device type CUDA), asked for its
  data on the legacy default stream (``stream=1``), which the engine's blocking stream follows;
* a raw ``dltensor`` ``PyCapsule``, as ``tf.experimental.dlpack.to_dlpack`` returns: its
  ``DLManagedTensor`` is read with ctypes; the capsule is consumed (renamed ``used_dltensor``) and
  its deleter called once the collective no longer needs the memory.

``device_tensor`` turns such an input into a ``DeviceTensor`` (pointer, shape, dtype,
device id; C-contiguous only), or returns None for host input (``device_tensors``: a list of
them).  ``host_array`` turns a CPU DLPack capsule, or a DLPack producer in host memory that is
not a numpy array, into a numpy array (``np.from_dlpack``: its memory, no copy);
``host_result`` gives such a producer's result back as its own kind.  Results go back as
the input's own kind (``DeviceTensor.wrap_result``): a ``GPUArray`` for a ``GPUArray``, the
producer's own module's ``from_dlpack`` (``torch``, ``cupy``, ...) for ``__dlpack__`` /
``__cuda_array_interface__`` objects, and a new ``dltensor`` capsule (built here with ctypes)
for a capsule.

Mirrors the DLPack C ABI (``dlpack.h`` v0.8: ``DLTensor``, ``DLManagedTensor``) and the CUDA Array
Interface v3; both are public specifications.
"""
import ctypes
import logging
import math
import sys
import threading
from typing import Optional, Tuple

import numpy as np

# DLPack device types and dtype codes (dlpack.h)
KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED = 1, 2, 3, 13
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT, _DL_BOOL = 0, 1, 2, 4, 6
CAPSULE_NAME = b"dltensor"
USED_CAPSULE_NAME = b"used_dltensor"
VERSIONED_NAME = b"dltensor_versioned"  # DLPack >= 1.0 (DLManagedTensorVersioned)
USED_VERSIONED_NAME = b"used_dltensor_versioned"


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


VERSIONED_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                                     ("deleter", VERSIONED_DELETER), ("flags", ctypes.c_uint64),
                                     ("dl_tensor", DLTensor)]

_api = ctypes.pythonapi
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def dtype_from_dlpack(dt: DLDataType) -> np.dtype:
    """The numpy dtype of a DLPack dtype; ``ValueError`` for vector lanes or unknown codes."""
    if dt.lanes != 1:
        raise ValueError(f"DLPack tensors with {dt.lanes} lanes are not supported")
    code, bits = dt.code, dt.bits
    if code == _DL_BFLOAT and bits == 16:
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    if code == _DL_BOOL and bits == 8:
        return np.dtype(np.bool_)
    kind = {_DL_INT: "i", _DL_UINT: "u", _DL_FLOAT: "f"}.get(code)
    if kind is None or bits % 8:
        raise ValueError(f"DLPack dtype code {code} with {bits} bits is not supported")
    return np.dtype(f"{kind}{bits // 8}")


def dtype_to_dlpack(dtype: np.dtype) -> DLDataType:
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return DLDataType(_DL_BFLOAT, 16, 1)
    code = {"b": _DL_BOOL, "i": _DL_INT, "u": _DL_UINT, "f": _DL_FLOAT}.get(dtype.kind)
    if code is None:
        raise ValueError(f"dtype {dtype} has no DLPack equivalent")
    return DLDataType(code, dtype.itemsize * 8, 1)


_TYPESTRS = {}


def _typestr_dtype(typestr: str) -> np.dtype:
    dtype = _TYPESTRS.get(typestr)
    if dtype is None:
        dtype = _TYPESTRS[typestr] = np.dtype(typestr)
    return dtype


def _check_contiguous(shape, strides, itemsize, what) -> None:
    """``ValueError`` unless ``strides`` (in elements, or None) describe a C-contiguous layout."""
    if strides is None:
        return
    expect = 1
    for dim, st in zip(reversed(shape), reversed(strides)):
        if dim != 1 and st != expect:
            raise ValueError(f"{what}: only C-contiguous device arrays are supported "
                             f"(shape {tuple(shape)}, strides {tuple(strides)} elements)")
        expect *= dim


class DeviceTensor:
    """A C-contiguous array in CUDA device memory: ``ptr`` (int), ``shape``, ``dtype``,
    ``device_id``; ``source`` is the caller's object, kept alive while the engine uses the memory.

    ``kind`` says how results go back: ``"gpuarray"``, ``"module"`` (``module.from_dlpack``),
    ``"capsule"``.  ``stream``: a CUDA stream handle to wait on before reading (None: none named).
    ``release()`` gives a consumed capsule back to its producer (calls its deleter) once."""

    device_type = KDL_CUDA  # of results (set per result: the numpy backend's stand-in memory is kDLCPU)
    _managed = None  # DLManagedTensor* of a consumed capsule, until release()

    def __init__(self, ptr, shape, dtype, device_id=0, source=None, kind="module", stream=None,
                 managed=None):
        self.ptr = int(ptr)
        self.shape = shape = tuple(map(int, shape))
        self.dtype = dtype = np.dtype(dtype)
        self.device_id = int(device_id)
        self.source, self.kind, self.stream = source, kind, stream
        self.size = size = math.prod(shape)
        self.nbytes = size * dtype.itemsize
        self.ndim = len(shape)
        if managed is not None:
            self._managed = managed

    @classmethod
    def of(cls, ptr: int, shape: tuple, dtype: np.dtype, source, stream) -> "DeviceTensor":
        """A ``"module"`` tensor from values already of their types (``shape`` a tuple of ints,
        ``dtype`` a numpy dtype), as a CuPy array's attributes give them: what ``__init__`` makes,
        without its conversions (~0.6 us less per tensor here)."""
        t = cls.__new__(cls)
        t.ptr, t.shape, t.dtype, t.device_id = ptr, shape, dtype, _pointer_device(ptr)
        t.source, t.kind, t.stream = source, "module", stream
        t.size = size = math.prod(shape)
        t.nbytes = size * dtype.itemsize
        t.ndim = len(shape)
        return t

    @property
    def parts(self) -> tuple:
        """The tensors whose memory this one reads: itself (a ``DeviceGroup``: its parts)."""
        return (self,)

    def pieces(self, base: int) -> list:
        """``(pointer, byte offset, bytes)`` of what this tensor packs, placed at byte ``base``."""
        return [(self.ptr, base, self.nbytes)]

    def views(self, base: int) -> list:
        """``(byte offset, shape)`` of each result this tensor gets, placed at byte ``base``."""
        return [(base, self.shape)]

    def release(self) -> None:
        m = self._managed
        if m is not None:
            self._managed = None
            if m.contents.deleter:
                m.contents.deleter(m)

    def __del__(self):
        if self._managed is not None:  # (a consumed capsule's tensor only)
            try:
                self.release()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def __repr__(self):
        return f"DeviceTensor(cuda:{self.device_id}, {self.dtype}, {self.shape}, 0x{self.ptr:x})"

    def module_name(self) -> Optional[str]:
        return type(self.source).__module__.split(".")[0] if self.source is not None else None

    def wrap_views(self, result: "DeviceTensor", views) -> Optional[list]:
        """Views of 1-D ``result`` as this tensor's kind: one per ``(byte offset, shape)`` of
        ``views``; None where the kind has no views (a capsule, an ``Exported``)."""
        if self.kind == "capsule":
            return None
        if self.module_name() == "cupy" and _cupy_wrap_works:
            try:
                cupy = sys.modules["cupy"]
                base = cupy.cuda.MemoryPointer(
                    cupy.cuda.UnownedMemory(result.ptr, result.nbytes, result.source, result.device_id), 0)
                return [cupy.ndarray(shape, result.dtype, base + offset) for offset, shape in views]
            except Exception as e:  # noqa: BLE001 - another CuPy: its from_dlpack still works
                _cupy_wrap_failed(e)
        whole = self.wrap_result(result)
        if not (hasattr(whole, "reshape") and hasattr(whole, "__getitem__")):
            return None
        item = result.dtype.itemsize
        return [whole[offset // item:offset // item + math.prod(shape)].reshape(shape) for offset, shape in views]

    def wrap_result(self, result: "DeviceTensor"):
        """``result`` (a ``DeviceTensor`` whose ``source`` owns the memory, see
        ``Exported``) as the kind of array this tensor came as."""
        exported = Exported(result)
        if self.kind == "gpuarray":
            return result.source.to_gpuarray(result) if hasattr(result.source, "to_gpuarray") else exported
        if self.kind == "capsule":
            return exported.__dlpack__()
        name = self.module_name() or ""
        mod = sys.modules.get(name)
        if name == "cupy" and _cupy_wrap_works:
            try:
                return _cupy_array(mod, result)
            except Exception as e:  # noqa: BLE001 - another CuPy: its from_dlpack still works
                _cupy_wrap_failed(e)
        from_dlpack = getattr(mod, "from_dlpack", None)
        if from_dlpack is None:
            return exported
        return from_dlpack(exported)


class DeviceGroup(DeviceTensor):
    """A flattened group of device tensors (``parts``: ``DeviceTensor`` objects of one
    dtype, device and kind) allreduced as one 1-D tensor of ``count`` elements, each part at element
    offset ``starts[i]`` (a ``Layout``'s; padding between parts is
    reduced and never read).  The parts are not contiguous: ``ptr`` is the first part's, naming
    the device only; the engine reads the parts themselves (one gather into its window)."""

    def __init__(self, parts: list, starts, count: int):
        first = parts[0]
        super().__init__(first.ptr, (count,), first.dtype, first.device_id, first.source, first.kind)
        self._parts, self.starts = parts, starts

    @property
    def parts(self) -> list:
        return self._parts

    def pieces(self, base: int) -> np.ndarray:
        """``(part pointer, byte offset, bytes)`` of every part, the group starting at byte ``base``:
        an (n, 3) uint64 array, the gather's table as it is (built by columns: 100 parts ~14 us,
        where a list of tuples and its conversion cost ~36 us)."""
        parts = self._parts
        table = np.empty((len(parts), 3), np.uint64)
        table[:, 0] = [p.ptr for p in parts]
        table[:, 1] = np.asarray(self.starts, np.uint64) * self.dtype.itemsize + base
        table[:, 2] = [p.nbytes for p in parts]
        return table

    def views(self, base: int) -> list:
        """``(byte offset, shape)`` of every part, the group starting at byte ``base``."""
        size = self.dtype.itemsize
        return [(base + s * size, p.shape) for p, s in zip(self.parts, self.starts)]


def same_kind(tensors) -> bool:
    """Whether every one of ``tensors`` (``DeviceTensor``) came as the same kind of array
    (the same ``kind`` and type of source), so one ``DeviceTensor.wrap_views`` serves them all."""
    first = tensors[0]
    kind, typ = first.kind, type(first.source)
    return all(t.kind == kind and type(t.source) is typ for t in tensors)


_cupy_wrap_works = True


def _cupy_wrap_failed(e: Exception) -> None:
    global _cupy_wrap_works
    _cupy_wrap_works = False
    logging.getLogger("sdp.engine.device").warning("CuPy results through cupy.from_dlpack: %r", e)


def _cupy_array(cupy, t: "DeviceTensor"):
    """``t`` as a CuPy array over the same memory (owned by ``t.source``): a few microseconds,
    where ``cupy.from_dlpack`` of an exported capsule takes ~50."""
    memory = cupy.cuda.UnownedMemory(t.ptr, t.nbytes, t.source, t.device_id)
    return cupy.ndarray(t.shape, t.dtype, cupy.cuda.MemoryPointer(memory, 0))


# -- recognising inputs -------------------------------------------------------------------------
def is_capsule(obj) -> bool:
    return type(obj).__name__ == "PyCapsule"


def _from_cai(obj, kind, cai=None) -> Optional[DeviceTensor]:
    """The tensor ``obj``'s ``__cuda_array_interface__`` (or ``cai``, read already) describes."""
    if cai is None:
        cai = obj.__cuda_array_interface__
    shape = tuple(cai["shape"])
    dtype = _typestr_dtype(cai["typestr"])
    if dtype.kind == "V":  # (PyTorch gives bfloat16 as '<V2': the interface has no name for it)
        raise TypeError(f"__cuda_array_interface__ typestr {cai['typestr']!r} names no numeric dtype")
    strides = cai.get("strides")
    if strides is not None:
        if any(s % dtype.itemsize for s in strides):
            raise ValueError(f"__cuda_array_interface__ strides {strides} are not multiples of the item size")
        _check_contiguous(shape, [s // dtype.itemsize for s in strides], dtype.itemsize,
                          type(obj).__name__)
    ptr = cai["data"][0] or 0
    stream = cai.get("stream")
    return DeviceTensor(ptr, shape, dtype, _pointer_device(ptr), obj, kind, stream if stream else None)


def _pointer_device(ptr: int) -> int:
    """The device a CUDA pointer lives on (0 when that cannot be told without a driver call:
    resolved by the backend when it first runs)."""
    return -1 if ptr else 0


def _capsule_name(capsule) -> bytes:
    """The name a valid, unconsumed DLPack capsule has; ``ValueError`` for anything else."""
    for name in (CAPSULE_NAME, VERSIONED_NAME):
        if _api.PyCapsule_IsValid(capsule, name):
            return name
    raise ValueError("not a DLPack 'dltensor' capsule (already consumed?)")


def _read_managed(capsule) -> Tuple[DLTensor, "ctypes._Pointer", bytes]:
    name = _capsule_name(capsule)
    ptr = _api.PyCapsule_GetPointer(capsule, name)
    kind = DLManagedTensorVersioned if name == VERSIONED_NAME else DLManagedTensor
    managed = ctypes.cast(ptr, ctypes.POINTER(kind))
    return managed.contents.dl_tensor, managed, name


def _tensor_from_dl(t: DLTensor, source, kind, managed, stream=None) -> DeviceTensor:
    dtype = dtype_from_dlpack(t.dtype)
    shape = [t.shape[i] for i in range(t.ndim)]
    strides = None if not t.strides else [t.strides[i] for i in range(t.ndim)]
    _check_contiguous(shape, strides, dtype.itemsize, "DLPack tensor")
    return DeviceTensor((t.data or 0) + t.byte_offset, shape, dtype, t.device.device_id, source, kind, stream,
                        managed)


def consume_capsule(capsule, kind="capsule") -> Tuple[Optional[DeviceTensor], Optional[np.ndarray]]:
    """Read a ``dltensor`` capsule: ``(DeviceTensor, None)`` for CUDA memory (the capsule is
    consumed; ``DeviceTensor.release`` calls its deleter), ``(None, ndarray)`` for host memory
    (numpy consumes it).  ``ValueError`` for a used capsule or another device type."""
    t, managed, name = _read_managed(capsule)
    dev = t.device.device_type
    if dev in (KDL_CPU, KDL_CUDA_HOST):
        return None, np.from_dlpack(_CapsuleHolder(capsule, dev, t.device.device_id))
    if dev not in (KDL_CUDA, KDL_CUDA_MANAGED):
        raise ValueError(f"DLPack device type {dev} is not supported (CPU and CUDA are)")
    tensor = _tensor_from_dl(t, capsule, kind, managed)
    _api.PyCapsule_SetName(capsule, USED_VERSIONED_NAME if name == VERSIONED_NAME else USED_CAPSULE_NAME)
    return tensor, None


class _CapsuleHolder:
    """A raw capsule dressed as a DLPack producer, for ``np.from_dlpack``."""

    def __init__(self, capsule, dev, dev_id):
        self._capsule, self._device = capsule, (dev, dev_id)

    def __dlpack__(self, stream=None, **_):
        return self._capsule

    def __dlpack_device__(self):
        return self._device


def device_tensor(obj) -> Optional[DeviceTensor]:
    """A ``DeviceTensor`` for an input in CUDA memory, None for anything else (host input,
    which the caller turns into numpy).  ``ValueError`` for a device array that is not
    C-contiguous or whose dtype the engine does not carry."""
    if isinstance(obj, (np.ndarray, np.generic, list, tuple, int, float, bool)) or obj is None:
        return None
    if isinstance(obj, DeviceTensor):
        return obj
    if is_capsule(obj):
        dt, _ = _peek_capsule(obj)
        return consume_capsule(obj)[0] if dt in (KDL_CUDA, KDL_CUDA_MANAGED) else None
    if hasattr(obj, "gpudata") and hasattr(obj, "__cuda_array_interface__"):
        return _from_cai(obj, "gpuarray")
    dl_device = getattr(obj, "__dlpack_device__", None)
    if dl_device is not None and hasattr(obj, "__dlpack__"):
        dev, _dev_id = dl_device()
        if int(dev) not in (KDL_CUDA, KDL_CUDA_MANAGED):
            return None
        try:  # no capsule needed; wait on the stream it names
            return _from_cai(obj, "module")
        except (AttributeError, TypeError, RuntimeError):  # (PyTorch's bfloat16 has no typestr)
            pass
        capsule = obj.__dlpack__(stream=1)  # ready on the legacy default stream, which ours follows
        t = consume_capsule(capsule, "module")[0]
        t.source = obj  # results go back through the producer's module
        t._capsule = capsule
        return t
    cai = getattr(obj, "__cuda_array_interface__", None)  # (a property: read once)
    return None if cai is None else _from_cai(obj, "module", cai)


def device_tensors(objs) -> list:
    """``[device_tensor(o) for o in objs]`` (same results, same errors), quicker for a list of
    CuPy arrays (a fused gradient list: 5-7 us per array on the H200 machine, most of it CuPy's
    ``__dlpack_device__`` and ``__cuda_array_interface__``): after the first, whose interface
    names the stream (the caller's current one, the same for the whole call), each contiguous
    array of the same type and a dtype the interface names is read from its attributes
    (pointer, shape, dtype).  Contiguity is CuPy's own flag, ``_c_contiguous`` (what
    ``flags.c_contiguous`` returns, without making a ``Flags`` object: ~0.03 against ~0.56 us an
    array here); an array without it is read as alone."""
    cupy_type = getattr(sys.modules.get("cupy"), "ndarray", None)
    out, stream, first = [], None, None
    for obj in objs:
        if type(obj) is first and getattr(obj, "_c_contiguous", False) and obj.dtype.kind != "V":  # (bfloat16:
            # as alone)
            out.append(DeviceTensor.of(obj.data.ptr, obj.shape, obj.dtype, obj, stream))
            continue
        t = device_tensor(obj)
        if first is None and t is not None and type(obj) is cupy_type and t._managed is None:
            first, stream = cupy_type, t.stream
        out.append(t)
    return out


def _peek_capsule(capsule) -> Tuple[int, int]:
    t, _, _ = _read_managed(capsule)
    return t.device.device_type, t.device.device_id


def host_array(obj) -> np.ndarray:
    """``obj`` as a numpy array: a CPU DLPack capsule, or a DLPack producer (``__dlpack__`` and
    ``__dlpack_device__``) in host memory, through ``np.from_dlpack`` (no copy); anything else
    through ``np.asarray``."""
    if is_capsule(obj):
        tensor, arr = consume_capsule(obj)
        if tensor is not None:
            raise ValueError("a CUDA DLPack capsule where host memory was expected")
        return arr
    if _host_producer(obj):
        return np.from_dlpack(obj)
    return np.asarray(obj)


def _host_producer(obj) -> bool:
    """True for a DLPack producer that is not a numpy array (its device is checked by
    ``np.from_dlpack``; device input was taken by ``device_tensor`` before)."""
    return (not isinstance(obj, (np.ndarray, np.generic)) and hasattr(obj, "__dlpack__")
            and hasattr(obj, "__dlpack_device__"))


def host_result(like, result):
    """``result`` (host memory) as the kind of ``like``, the host input of a collective: a DLPack
    producer that is not a numpy array gets its module's ``from_dlpack`` of it (e.g.
    ``torch.from_dlpack``: no copy), where the module has one; anything else ``result`` itself."""
    if type(like) is np.ndarray or not _host_producer(like):
        return result
    from_dlpack = getattr(sys.modules.get(type(like).__module__.split(".")[0]), "from_dlpack", None)
    if from_dlpack is None:
        return result
    if isinstance(result, (list, tuple)):
        return type(result)(from_dlpack(r) for r in result)
    return from_dlpack(result)


# -- exporting results ------------------------------------------------------------------------
_live_lock = threading.Lock()
_live = {}  # address of a DLManagedTensor we made -> (struct, shape array, owner)


@DELETER
def _delete_managed(managed):
    with _live_lock:
        _live.pop(ctypes.addressof(managed.contents), None)


@_CAPSULE_DESTRUCTOR
def _destroy_capsule(capsule_ptr):
    # an unconsumed capsule still owns its tensor: free it (a consumer renames it first)
    obj = ctypes.cast(capsule_ptr, ctypes.py_object)
    if _api.PyCapsule_IsValid(obj, CAPSULE_NAME):
        ptr = _api.PyCapsule_GetPointer(obj, CAPSULE_NAME)
        managed = ctypes.cast(ptr, ctypes.POINTER(DLManagedTensor))
        managed.contents.deleter(managed)


def make_capsule(ptr: int, shape, dtype, device_type: int, device_id: int, owner) -> object:
    """A new ``dltensor`` capsule over ``ptr`` (C-contiguous ``shape`` of ``dtype``) on the given
    DLPack device; ``owner`` is kept alive until the consumer calls the deleter (or the capsule
    is destroyed unconsumed)."""
    m = DLManagedTensor()
    shp = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    m.dl_tensor.data = ptr or None
    m.dl_tensor.device = DLDevice(device_type, device_id)
    m.dl_tensor.ndim = len(shape)
    m.dl_tensor.dtype = dtype_to_dlpack(dtype)
    m.dl_tensor.shape = ctypes.cast(shp, ctypes.POINTER(ctypes.c_int64))
    m.dl_tensor.strides = None
    m.dl_tensor.byte_offset = 0
    m.manager_ctx = None
    m.deleter = _delete_managed
    with _live_lock:
        _live[ctypes.addressof(m)] = (m, shp, owner)
    return _api.PyCapsule_New(ctypes.addressof(m), CAPSULE_NAME,
                              ctypes.cast(_destroy_capsule, ctypes.c_void_p))


class Exported:
    """A result in device memory offered to any consumer: ``__dlpack__``/``__dlpack_device__``
    and ``__cuda_array_interface__`` (v3, no stream: the engine synchronised before returning).
    Keeps the allocation (``tensor.source``) alive as long as any consumer holds it."""

    def __init__(self, tensor: DeviceTensor):
        self.tensor = tensor
        self.shape, self.dtype = tensor.shape, tensor.dtype

    def __dlpack__(self, stream=None, **_):
        t = self.tensor
        return make_capsule(t.ptr, t.shape, t.dtype, t.device_type, t.device_id, self)

    def __dlpack_device__(self):
        return self.tensor.device_type, self.tensor.device_id

    @property
    def __cuda_array_interface__(self):
        t = self.tensor
        if t.dtype.name == "bfloat16":
            raise TypeError("bfloat16 has no __cuda_array_interface__ typestr; use DLPack")
        return {"shape": t.shape, "typestr": t.dtype.str, "data": (t.ptr, False), "strides": None,
                "version": 3, "stream": None}
