"""The PyCUDA backend of the device path (see :mod:`sdp.engine.backends` for the interface).

Imported only when a CUDA array reaches the engine (never by ``sdprun``, never before a fork).
One CUDA context per process: the device's *primary* context
(``Device.retain_primary_context()``), the one the CUDA runtime, TensorFlow, PyTorch and CuPy use,
so pointers pass between them unchanged; the engine thread pushes it around its device work
(``with backend:``) and pops it after.  Work goes on one blocking stream of the engine's (it
follows the legacy default stream); results are synchronised before they are handed out.

Kernels (``SourceModule``, compiled by nvcc once and cached by PyCUDA): ``reduce_<dtype>`` for
float16 and bfloat16 (``cuda_fp16.h`` / ``cuda_bf16.h``, accumulated in float32), float32,
float64 and the 8/16/32/64-bit integers (bool runs as uint8), every op of
:func:`sdp.engine.backends.reduce_arrays` with its arithmetic exactly (compiled with
``--fmad=false`` so that no multiply-add is fused); up to :data:`MAX_PTRS` sources and
destinations per launch; and ``gather_copy``, which copies many pieces into one buffer in a
single launch (16-byte vectors where aligned).  Allocations come from PyCUDA's
``DeviceMemoryPool``; the IPC window is a plain ``mem_alloc`` (exportable with
``mem_get_ipc_handle``, opened by peers with ``IPCMemoryHandle``).
"""
import collections
import ctypes
import logging
import time
from typing import List, Optional

import numpy as np
import pycuda.driver as cuda
from pycuda.compiler import SourceModule
from pycuda.tools import DeviceMemoryPool

from sdp.common.reduce_ops import ReduceOp
from sdp.engine.backends import Allocation, Backend, bool_op

log = logging.getLogger("sdp.engine.device")

SPIN_S = 0.002  # seconds synchronize() polls before it blocks
MAX_PTRS = 8  # sources/destinations of one reduce launch (ranks of one host on the IPC path)
THREADS = 256
_ZEROS = (0,) * MAX_PTRS  # padding of the kernel's pointer arrays

_DTYPES = {  # numpy dtype name -> (CUDA type, kernel suffix)
    "float16": ("__half", "f16"), "bfloat16": ("__nv_bfloat16", "bf16"), "float32": ("float", "f32"),
    "float64": ("double", "f64"), "int8": ("signed char", "i8"), "uint8": ("unsigned char", "u8"),
    "int16": ("short", "i16"), "uint16": ("unsigned short", "u16"), "int32": ("int", "i32"),
    "uint32": ("unsigned int", "u32"), "int64": ("long long", "i64"), "uint64": ("unsigned long long", "u64"),
}

KERNELS = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

struct P8 { unsigned long long p[8]; };

template <typename T> struct Acc { typedef T type; };
template <> struct Acc<__half> { typedef float type; };
template <> struct Acc<__nv_bfloat16> { typedef float type; };
template <typename T> struct IsInt { enum { value = 1 }; };
template <> struct IsInt<__half> { enum { value = 0 }; };
template <> struct IsInt<__nv_bfloat16> { enum { value = 0 }; };
template <> struct IsInt<float> { enum { value = 0 }; };
template <> struct IsInt<double> { enum { value = 0 }; };
template <typename T> struct Unsigned { typedef T type; };
template <> struct Unsigned<signed char> { typedef unsigned char type; };
template <> struct Unsigned<short> { typedef unsigned short type; };
template <> struct Unsigned<int> { typedef unsigned int type; };
template <> struct Unsigned<long long> { typedef unsigned long long type; };

template <typename T> __device__ __forceinline__ typename Acc<T>::type load(const T* p) { return *p; }
template <> __device__ __forceinline__ float load<__half>(const __half* p) { return __half2float(*p); }
template <> __device__ __forceinline__ float load<__nv_bfloat16>(const __nv_bfloat16* p) { return __bfloat162float(*p); }
template <typename T> __device__ __forceinline__ T round_to(typename Acc<T>::type v) { return (T)v; }
template <> __device__ __forceinline__ __half round_to<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 round_to<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <typename T> __device__ __forceinline__ typename Acc<T>::type back(T v) { return (typename Acc<T>::type)v; }
template <> __device__ __forceinline__ float back<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float back<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// op: 0 AVERAGE, 1 SUM, 3 MIN, 4 MAX, 5 PRODUCT (Horovod's numbering)
template <typename A> __device__ __forceinline__ A combine_f(int op, A a, A b) {
  if (op == 3) return (b != b) ? b : ((a < b || a != a) ? a : b);
  if (op == 4) return (b != b) ? b : ((a > b || a != a) ? a : b);
  if (op == 5) return a * b;
  return a + b;
}
template <typename T> __device__ __forceinline__ T combine_i(int op, T a, T b) {
  typedef typename Unsigned<T>::type U;
  if (op == 3) return a < b ? a : b;
  if (op == 4) return a > b ? a : b;
  if (op == 5) return (T)((U)a * (U)b);
  return (T)((U)a + (U)b);
}
template <typename T> __device__ __forceinline__ T floor_div(T a, long long n) {
  T q = (T)(a / (T)n);
  if ((T)(a % (T)n) != 0 && ((a < (T)0) != (n < 0))) q = (T)(q - 1);
  return q;
}

// one element's arithmetic: start (first source), step (each further source), finish
template <typename T, int INT> struct Elem;

template <typename T> struct Elem<T, 0> {  // floats (16-bit ones in float32)
  typedef typename Acc<T>::type A;
  int op; A fpre, fscale; bool has_pre, has_scale;
  __device__ Elem(int op_, double pre, double scale, long long, double)
      : op(op_), fpre((A)pre), fscale((A)scale), has_pre(pre != 1.0), has_scale(scale != 1.0) {}
  __device__ __forceinline__ A start(T x) const { A v = back<T>(x); return has_pre ? back<T>(round_to<T>(v * fpre)) : v; }
  __device__ __forceinline__ A step(A acc, T x) const { return combine_f<A>(op, acc, start(x)); }
  __device__ __forceinline__ T finish(A acc) const { return round_to<T>(has_scale ? acc * fscale : acc); }
};

template <typename T> struct Elem<T, 1> {  // integers
  typedef T A;
  int op; double pre, post; long long divide; bool has_pre, has_post;
  __device__ Elem(int op_, double pre_, double, long long divide_, double post_)
      : op(op_), pre(pre_), post(post_), divide(divide_), has_pre(pre_ != 1.0), has_post(post_ != 1.0) {}
  __device__ __forceinline__ T start(T x) const { return has_pre ? (T)((double)x * pre) : x; }
  __device__ __forceinline__ T step(T acc, T x) const { return combine_i<T>(op, acc, start(x)); }
  __device__ __forceinline__ T finish(T acc) const {
    if (op == 0 && divide != 1) acc = floor_div<T>(acc, divide);
    return has_post ? (T)((double)acc * post) : acc;
  }
};

template <typename T> struct __align__(16) Pack { T v[16 / sizeof(T)]; };

// vec: every pointer is 16-byte aligned, so whole 16-byte packs are read and written (the same
// arithmetic per element); the tail (and everything when vec is 0) goes element by element
template <typename T> __device__ void reduce_run(const P8& srcs, int nsrc, const P8& dsts, int ndst, long long count,
                                                int op, double pre, double scale, long long divide, double post,
                                                int vec) {
  typedef Elem<T, IsInt<T>::value> E;
  typedef typename E::A A;
  const E e(op, pre, scale, divide, post);
  const int V = 16 / sizeof(T);
  const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  const long long stride = (long long)blockDim.x * gridDim.x;
  const long long packs = vec ? count / V : 0;
  for (long long j = first; j < packs; j += stride) {
    const Pack<T> x = ((const Pack<T>*)srcs.p[0])[j];
    A acc[16 / sizeof(T)];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = e.start(x.v[k]);
    for (int s = 1; s < nsrc; ++s) {
      const Pack<T> y = ((const Pack<T>*)srcs.p[s])[j];
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = e.step(acc[k], y.v[k]);
    }
    Pack<T> out;
#pragma unroll
    for (int k = 0; k < V; ++k) out.v[k] = e.finish(acc[k]);
    for (int d = 0; d < ndst; ++d) ((Pack<T>*)dsts.p[d])[j] = out;
  }
  for (long long i = packs * V + first; i < count; i += stride) {
    A acc = e.start(((const T*)srcs.p[0])[i]);
    for (int s = 1; s < nsrc; ++s) acc = e.step(acc, ((const T*)srcs.p[s])[i]);
    const T out = e.finish(acc);
    for (int d = 0; d < ndst; ++d) ((T*)dsts.p[d])[i] = out;
  }
}

#define REDUCE(T, NAME) \
extern "C" __global__ void reduce_##NAME(P8 srcs, int nsrc, P8 dsts, int ndst, long long count, int op, \
                                         double pre, double scale, long long divide, double post, int vec) { \
  reduce_run<T>(srcs, nsrc, dsts, ndst, count, op, pre, scale, divide, post, vec); \
}
REDUCE(__half, f16) REDUCE(__nv_bfloat16, bf16) REDUCE(float, f32) REDUCE(double, f64)
REDUCE(signed char, i8) REDUCE(unsigned char, u8) REDUCE(short, i16) REDUCE(unsigned short, u16)
REDUCE(int, i32) REDUCE(unsigned int, u32) REDUCE(long long, i64) REDUCE(unsigned long long, u64)

// pieces: n triples (source pointer, destination offset in bytes, bytes); blockIdx.y walks them
extern "C" __global__ void gather_copy(const unsigned long long* pieces, int n, unsigned long long dst) {
  for (int t = blockIdx.y; t < n; t += gridDim.y) {
    const char* src = (const char*)pieces[3 * t];
    char* out = (char*)(dst + pieces[3 * t + 1]);
    const long long nbytes = (long long)pieces[3 * t + 2];
    const long long stride = (long long)blockDim.x * gridDim.x;
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long vec = 0;
    if ((((unsigned long long)src | (unsigned long long)out) & 15) == 0) {
      vec = nbytes / 16;
      for (long long i = first; i < vec; i += stride) ((uint4*)out)[i] = ((const uint4*)src)[i];
      vec *= 16;
    }
    for (long long i = vec + first; i < nbytes; i += stride) out[i] = src[i];
  }
}
"""

_REDUCE_ARGS = "Q" * 8 + "i" + "Q" * 8 + "iqiddqdi"  # the kernel's parameters; packed with native alignment, as C lays them out


class CudaBackend(Backend):
    """PyCUDA on device ``device_id``'s primary context (see the module docstring)."""

    name = "cuda"
    device_type = 2  # kDLCUDA

    def __init__(self, device_id: int = 0):
        super().__init__()
        cuda.init()
        self.device_id = device_id
        self.device = cuda.Device(device_id)
        self.context = self.device.retain_primary_context()
        self._retired = collections.deque()  # allocations let go of outside the engine thread
        with self:
            self.stream = cuda.Stream()
            self._done = cuda.Event(cuda.event_flags.DISABLE_TIMING)
            self.pool = DeviceMemoryPool()
            self.module = SourceModule(KERNELS, no_extern_c=True,
                                       options=["--fmad=false", "-std=c++17", "-diag-suppress=186"])
            self._reduce, self._by_dtype = {}, {}
            for name, (_ctype, suffix) in _DTYPES.items():
                f = self.module.get_function(f"reduce_{suffix}")
                f.prepare(_REDUCE_ARGS)
                self._reduce[name] = f
            self._gather = self.module.get_function("gather_copy")
            self._gather.prepare("PiQ")
            self.sm_count = self.device.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)
        self._staging: Optional[np.ndarray] = None
        self._pieces = None  # device buffer for gather_copy's piece table
        self._pieces_host = None

    def __enter__(self):
        self.context.push()
        while self._retired:  # freed here, in this context (PyCUDA's pool needs one)
            self._retired.popleft()
        return self

    def retire(self, alloc: Allocation) -> None:
        self._retired.append(alloc)

    def close(self) -> None:
        self._retired.clear()
        self._staging = self._pieces = self._pieces_host = None
        self.pool.stop_holding()
        # every CUDA object goes now, in this context: one left to the interpreter's exit is freed
        # with no context current (PyCUDA warns "... in out-of-thread context could not be cleaned up")
        self.module = self._reduce = self._gather = self._by_dtype = self.stream = self._done = None

    def __exit__(self, *exc):
        cuda.Context.pop()
        return False

    # -- memory ----------------------------------------------------------------------------------
    def alloc(self, nbytes: int, exportable: bool = False) -> Allocation:
        if exportable:  # its own cuMemAlloc: an IPC handle names a whole allocation
            a = cuda.mem_alloc(max(nbytes, 1))
        else:
            a = self.pool.allocate(max(nbytes, 1))
        return Allocation(int(a), nbytes, a)

    def host_buffer(self, nbytes: int) -> np.ndarray:
        if self._staging is None or self._staging.nbytes < nbytes:
            self._staging = None
            self._staging = cuda.pagelocked_empty(max(nbytes, 1 << 20), np.uint8)
        return self._staging[:nbytes]

    def memory_info(self) -> str:
        free, total = cuda.mem_get_info()
        return f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free on device {self.device_id}"

    # -- copies ------------------------------------------------------------------------------------
    def copy(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes:
            cuda.memcpy_dtod_async(dst, src, nbytes, self.stream)
            self.counters["d2d"] += nbytes

    def gather(self, dst: int, pieces) -> None:
        if len(pieces) <= 2:
            return super().gather(dst, pieces)
        n = len(pieces)
        if self._pieces_host is None or self._pieces_host.size < 3 * n:
            size = max(3 * n, 3 * 256)
            self._pieces_host = cuda.pagelocked_empty(size, np.uint64)
            self._pieces = cuda.mem_alloc(size * 8)
        table = self._pieces_host[:3 * n].reshape(n, 3)
        table[:] = pieces
        # the table's previous use has finished (every operation is synchronised before the
        # thread that ran it lets DevicePath.lock go), so it can be overwritten
        cuda.memcpy_htod_async(self._pieces, table, self.stream)
        largest = int(table[:, 2].max())
        blocks_x = max(1, min(64, -(-largest // (THREADS * 16))))
        self._gather.prepared_async_call((blocks_x, min(n, 65535)), (THREADS, 1, 1), self.stream,
                                         self._pieces, n, dst)
        self.counters["d2d"] += int(table[:, 2].sum())
        self.counters["h2d"] += table.nbytes
        self.counters["kernels"] += 1

    def to_host(self, dst: np.ndarray, src: int) -> None:
        if dst.nbytes:
            cuda.memcpy_dtoh_async(dst, src, self.stream)
            self.synchronize()
            self.counters["d2h"] += dst.nbytes

    def to_device(self, dst: int, src: np.ndarray, wait: bool = True) -> None:
        if src.nbytes:
            cuda.memcpy_htod_async(dst, np.ascontiguousarray(src), self.stream)
            if wait:
                self.synchronize()
            self.counters["h2d"] += src.nbytes

    # -- kernels -----------------------------------------------------------------------------------
    def reduce(self, srcs: List[int], dsts: List[int], count: int, dtype, op: ReduceOp, prescale: float,
               scale: Optional[float], divide: int, postscale: float) -> None:
        if not count:
            return
        if len(srcs) > MAX_PTRS or len(dsts) > MAX_PTRS:
            raise ValueError(f"a device reduction takes at most {MAX_PTRS} sources and destinations")
        f, is_bool = self._kernel_for(dtype)
        if is_bool:
            op = bool_op(op)
        vec = all(p & 15 == 0 for p in srcs) and all(p & 15 == 0 for p in dsts)
        work = -(-count // (16 // np.dtype(dtype).itemsize)) if vec else count
        blocks = max(1, min(-(-work // THREADS), self.sm_count * 8))
        f.prepared_async_call((blocks, 1), (THREADS, 1, 1), self.stream,
                              *srcs, *_ZEROS[len(srcs):], len(srcs), *dsts, *_ZEROS[len(dsts):], len(dsts), count,
                              int(op), float(prescale), 1.0 if scale is None else float(scale), int(divide),
                              float(postscale), int(vec))
        self.counters["kernels"] += 1

    def _kernel_for(self, dtype):
        """(the reduce kernel of ``dtype``, whether it is bool), cached per dtype."""
        got = self._by_dtype.get(dtype)
        if got is None:
            dt = np.dtype(dtype)
            got = self._by_dtype[dtype] = (self._reduce["uint8" if dt == np.bool_ else dt.name], dt == np.bool_)
        return got

    def synchronize(self) -> None:
        """Wait for the stream by polling an event for up to :data:`SPIN_S` (a blocking
        ``cuStreamSynchronize`` took ~130 us to return on an idle H200), then blocking."""
        self._done.record(self.stream)
        deadline = time.perf_counter() + SPIN_S
        while not self._done.query():
            if time.perf_counter() > deadline:
                self._done.synchronize()
                return

    def pin(self, array: np.ndarray):
        """Page-lock ``array``'s memory (``cuMemHostRegister``, portable) for fast copies; returns
        the registration, whose ``release()`` unregisters it.  (The driver call directly:
        PyCUDA 2026.1's ``register_host_memory`` fails under numpy 2 setting the result's base.)"""
        return _Registration(array)

    def wait_inputs(self, tensors) -> None:
        """Wait for the streams the producers named (``__cuda_array_interface__``'s ``stream``),
        each once.  Nothing for the legacy default stream (1): the engine's stream is a blocking
        one, which CUDA orders after the legacy default stream's earlier work.  A DLPack capsule
        names no stream and the per-thread default stream (2) is the producer thread's own, so
        either synchronises the whole context."""
        streams = set()
        for t in tensors:
            if t.kind == "capsule" or t.stream == 2:
                cuda.Context.synchronize()
                return
            if t.stream is not None and t.stream != 1:
                streams.add(int(t.stream))
        for handle in streams:
            _cu_stream_synchronize(handle)

    # -- inter-process ---------------------------------------------------------------------------
    def ipc_export(self, alloc: Allocation) -> Optional[bytes]:
        return bytes(cuda.mem_get_ipc_handle(alloc.ptr))

    def ipc_open(self, handle: bytes, nbytes: int) -> Allocation:
        h = cuda.IPCMemoryHandle(bytearray(handle))
        return Allocation(int(h), nbytes, h)


_libcuda = None


def _lib():
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
        _libcuda.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        _libcuda.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        _libcuda.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    return _libcuda


class _Registration:
    """``array``'s pages registered with the driver until :meth:`release` (in the backend's context)."""

    def __init__(self, array: np.ndarray):
        self.array, self.ptr = array, array.ctypes.data
        rc = _lib().cuMemHostRegister_v2(self.ptr, array.nbytes, 1)  # CU_MEMHOSTREGISTER_PORTABLE
        if rc != 0:
            raise cuda.Error(f"cuMemHostRegister of {array.nbytes} bytes failed with CUDA error {rc}")

    def release(self) -> None:
        if self.array is not None:
            _lib().cuMemHostUnregister(self.ptr)
            self.array = None


def _cu_stream_synchronize(handle: int) -> None:
    """``cuStreamSynchronize`` on a stream PyCUDA did not make (a producer's, by handle)."""
    rc = _lib().cuStreamSynchronize(ctypes.c_void_p(handle))
    if rc != 0:
        raise cuda.Error(f"cuStreamSynchronize({handle:#x}) failed with CUDA error {rc}")


def device_count() -> int:
    cuda.init()
    return cuda.Device.count()


def pointer_device(ptr: int) -> int:
    """The device ordinal of a CUDA pointer (``cuPointerGetAttribute``)."""
    ordinal = ctypes.c_int(-1)
    rc = _lib().cuPointerGetAttribute(ctypes.byref(ordinal), 9, ctypes.c_uint64(ptr))  # DEVICE_ORDINAL
    if rc != 0:
        raise cuda.Error(f"cuPointerGetAttribute(0x{ptr:x}) failed with CUDA error {rc}: not a device pointer?")
    return ordinal.value

