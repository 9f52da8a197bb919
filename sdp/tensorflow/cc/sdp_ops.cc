// sdp's compiled TensorFlow op, built by `python -m sdp.tensorflow.build_ops` (or on first use)
// and used by sdp/tensorflow/ops.py.
//
// SdpCheck gives a graph collective's failure TensorFlow's status code.  sdp's collectives in
// graphs are tf.numpy_function ops, and TensorFlow turns an exception raised in one into a status
// by its Python class only (ValueError -> INVALID_ARGUMENT).  So when a collective fails with an
// error that has a TensorFlow class, sdp's numpy_function does not raise: it registers the status
// under the buffer it returns as its first result (a fresh one-element placeholder, taken by
// TensorFlow without a copy) with sdp_check_fail(), and the SdpCheck op fed the results fails with
// that status (FAILED_PRECONDITION for ranks that disagree, as Horovod's kernels).  Otherwise it
// forwards the results without a copy.  No extra output carries the status: one more
// numpy_function output cost ~6-15 us per call, this op ~3 us.
// SdpCall (built when Python's and numpy's headers are there: -DSDP_CALL) runs a graph collective
// instead of a tf.numpy_function: its kernel calls the Python function registered under its
// `token` attribute (sdp_call_registry(): a mapping token -> function, sdp/tensorflow/ops.py) with
// read-only numpy views of its inputs, and takes the returned list of numpy arrays as its outputs
// (without a copy where an array is C-contiguous, aligned and of the output's dtype), or sets the
// returned (code, message) as its status.  A tf.function of one 1 KB allreduce between 2 ranks:
// 201-202 us with numpy_function, 170-171 us with this op, 123-124 us for an empty one
// (benchmarks/tf_call_op.py).
#ifdef SDP_CALL  // (Python's header first, as it asks)
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <cstring>
#include <vector>
#endif
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#ifdef SDP_CALL
#include "tensorflow/core/framework/allocation_description.pb.h"
#endif
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace sdp_tf {
namespace {

struct Failures {
  std::mutex mu;
  std::unordered_map<const void*, std::pair<int, std::string>> by_buffer;  // guarded by mu
};

Failures& failures() {
  static Failures* f = new Failures();  // never destroyed: kernels may run during exit
  return *f;
}

std::atomic<int64_t> pending{0};  // entries in failures().by_buffer

absl::StatusCode AsCode(int code) {  // a code outside absl's range becomes UNKNOWN
  const bool known = code > 0 && code <= static_cast<int>(absl::StatusCode::kUnauthenticated);
  return known ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
}

}  // namespace

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::shape_inference::InferenceContext;

// tensors: one collective op's results.
REGISTER_OP("SdpCheck")
    .Attr("T: list(type) >= 1")
    .Input("tensors: T")
    .Output("out: T")
    .SetIsStateful()  // runs in a tf.function even when nothing reads its outputs
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->input(i));
      return absl::OkStatus();
    });

class SdpCheckOp : public OpKernel {
 public:
  explicit SdpCheckOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  // Cheap: the executor runs it inline on the thread that finished its inputs (an "expensive"
  // kernel is handed to another inter-op thread: a wake-up per collective).
  bool IsExpensive() override { return false; }

  void Compute(OpKernelContext* ctx) override {
    const int n = ctx->num_outputs();
    if (pending.load(std::memory_order_acquire) > 0) {
      const void* data = ctx->input(0).tensor_data().data();
      Failures& f = failures();
      std::lock_guard<std::mutex> lock(f.mu);
      auto it = f.by_buffer.find(data);
      if (data != nullptr && it != f.by_buffer.end()) {
        ctx->SetStatus(absl::Status(AsCode(it->second.first), it->second.second));
        f.by_buffer.erase(it);
        pending.fetch_sub(1, std::memory_order_release);
        return;
      }
    }
    for (int i = 0; i < n; ++i) ctx->set_output(i, ctx->input(i));  // shares the buffers
  }
};

REGISTER_KERNEL_BUILDER(Name("SdpCheck").Device(tensorflow::DEVICE_CPU), SdpCheckOp);

// The address of its input's buffer: sdp's self-test (sdp/tensorflow/build_ops.py) checks with it
// that TensorFlow takes an aligned numpy_function result without a copy, as SdpCheck needs.
REGISTER_OP("SdpBufferAddress")
    .Attr("T: type")
    .Input("tensor: T")
    .Output("address: int64")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    });

class SdpBufferAddressOp : public OpKernel {
 public:
  explicit SdpBufferAddressOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    tensorflow::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tensorflow::TensorShape({}), &out));
    out->scalar<int64_t>()() = reinterpret_cast<int64_t>(ctx->input(0).tensor_data().data());
  }
};

REGISTER_KERNEL_BUILDER(Name("SdpBufferAddress").Device(tensorflow::DEVICE_CPU), SdpBufferAddressOp);

#ifdef SDP_CALL
namespace {

PyObject* registry = nullptr;  // token -> Python function (sdp_call_registry); read with the GIL held

// Output arrays TensorFlow let go of: decref'ed by the next SdpCall with the GIL (a tensor's
// buffer may be released on any thread, with or without the GIL).
std::mutex drop_mu;
std::vector<PyObject*>* drop = new std::vector<PyObject*>();  // guarded by drop_mu; never destroyed

class NumpyBuffer : public tensorflow::TensorBuffer {  // an output's memory: the function's array, held
 public:
  explicit NumpyBuffer(PyArrayObject* a) : TensorBuffer(PyArray_DATA(a)), array_(a), bytes_(PyArray_NBYTES(a)) {
    Py_INCREF(a);
  }
  ~NumpyBuffer() override {
    std::lock_guard<std::mutex> lock(drop_mu);
    drop->push_back(reinterpret_cast<PyObject*>(array_));
  }
  size_t size() const override { return bytes_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(tensorflow::AllocationDescription* d) const override {
    d->set_requested_bytes(bytes_);
    d->set_allocator_name("sdp_numpy");
  }
  bool OwnsMemory() const override { return false; }

 private:
  PyArrayObject* array_;
  size_t bytes_;
};

int NumpyType(tensorflow::DataType t) {  // -1: not carried (the Python side uses numpy_function)
  switch (t) {
    case tensorflow::DT_FLOAT: return NPY_FLOAT32;
    case tensorflow::DT_DOUBLE: return NPY_FLOAT64;
    case tensorflow::DT_HALF: return NPY_FLOAT16;
    case tensorflow::DT_INT8: return NPY_INT8;
    case tensorflow::DT_INT16: return NPY_INT16;
    case tensorflow::DT_INT32: return NPY_INT32;
    case tensorflow::DT_INT64: return NPY_INT64;
    case tensorflow::DT_UINT8: return NPY_UINT8;
    case tensorflow::DT_UINT16: return NPY_UINT16;
    case tensorflow::DT_UINT32: return NPY_UINT32;
    case tensorflow::DT_UINT64: return NPY_UINT64;
    case tensorflow::DT_BOOL: return NPY_BOOL;
    case tensorflow::DT_COMPLEX64: return NPY_COMPLEX64;
    case tensorflow::DT_COMPLEX128: return NPY_COMPLEX128;
    default: return -1;
  }
}

void ReleaseTensor(PyObject* capsule) {
  delete static_cast<tensorflow::Tensor*>(PyCapsule_GetPointer(capsule, "sdp.tensor"));
}

// A read-only numpy view of t (holding a reference to its buffer), or nullptr (a Python error).
PyObject* AsArray(const tensorflow::Tensor& t) {
  npy_intp dims[NPY_MAXDIMS];
  if (t.dims() > NPY_MAXDIMS) return PyErr_Format(PyExc_ValueError, "%d dimensions", t.dims()), nullptr;
  for (int d = 0; d < t.dims(); ++d) dims[d] = t.dim_size(d);
  const int type = NumpyType(t.dtype());
  if (t.NumElements() == 0) {  // (no buffer to view: an empty array, read-only as the others)
    PyObject* a = PyArray_SimpleNew(t.dims(), dims, type);
    if (a) PyArray_CLEARFLAGS(reinterpret_cast<PyArrayObject*>(a), NPY_ARRAY_WRITEABLE);
    return a;
  }
  PyObject* a = PyArray_New(&PyArray_Type, t.dims(), dims, type, nullptr, const_cast<char*>(t.tensor_data().data()),
                            0, NPY_ARRAY_CARRAY_RO, nullptr);
  PyObject* base = a ? PyCapsule_New(new tensorflow::Tensor(t), "sdp.tensor", ReleaseTensor) : nullptr;
  if (a && (!base || PyArray_SetBaseObject(reinterpret_cast<PyArrayObject*>(a), base) < 0)) {
    Py_XDECREF(base);
    Py_DECREF(a);
    return nullptr;
  }
  return a;
}

// The pending Python error as a status (and cleared).
absl::Status PythonError(const char* what) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyObject* text = value ? PyObject_Str(value) : nullptr;
  const char* utf8 = text ? PyUnicode_AsUTF8(text) : nullptr;
  absl::Status status(absl::StatusCode::kInternal, std::string(what) + (utf8 ? utf8 : "(no message)"));
  PyErr_Clear();
  Py_XDECREF(text), Py_XDECREF(type), Py_XDECREF(value), Py_XDECREF(tb);
  return status;
}

}  // namespace

REGISTER_OP("SdpCall")
    .Attr("token: int")
    .Attr("Tin: list(type) >= 0")
    .Attr("Tout: list(type) >= 0")
    .Input("inputs: Tin")
    .Output("outputs: Tout")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->UnknownShape());
      return absl::OkStatus();
    });

class SdpCallOp : public OpKernel {
 public:
  explicit SdpCallOp(OpKernelConstruction* ctx) : OpKernel(ctx) { OP_REQUIRES_OK(ctx, ctx->GetAttr("token", &token_)); }

  void Compute(OpKernelContext* ctx) override {
    if (!Py_IsInitialized()) {
      ctx->SetStatus(absl::CancelledError("sdp: Python is shutting down"));
      return;
    }
    PyGILState_STATE gil = PyGILState_Ensure();
    Call(ctx);
    PyGILState_Release(gil);
  }

 private:
  void Call(OpKernelContext* ctx) {  // (the GIL held)
    std::vector<PyObject*> dropped;
    {
      std::lock_guard<std::mutex> lock(drop_mu);
      dropped.swap(*drop);
    }
    for (PyObject* o : dropped) Py_DECREF(o);
    static const bool numpy_ok = _import_array() >= 0;
    if (!numpy_ok || registry == nullptr) {
      ctx->SetStatus(numpy_ok ? absl::InternalError("sdp: no function registry") : PythonError("sdp: numpy: "));
      return;
    }
    PyObject* key = PyLong_FromLongLong(token_);
    PyObject* fn = key ? PyObject_GetItem(registry, key) : nullptr;
    Py_XDECREF(key);
    PyObject* args = fn ? PyTuple_New(ctx->num_inputs()) : nullptr;
    for (int i = 0; args && i < ctx->num_inputs(); ++i) {
      PyObject* a = AsArray(ctx->input(i));
      if (!a) Py_CLEAR(args);
      else PyTuple_SET_ITEM(args, i, a);
    }
    PyObject* got = args ? PyObject_Call(fn, args, nullptr) : nullptr;
    Py_XDECREF(args), Py_XDECREF(fn);
    if (!got) {
      ctx->SetStatus(PythonError("sdp: "));
      return;
    }
    if (PyTuple_Check(got) && PyTuple_GET_SIZE(got) == 2) {  // (code, message): the collective failed
      const long code = PyLong_AsLong(PyTuple_GET_ITEM(got, 0));
      char* text = nullptr;
      Py_ssize_t length = 0;
      if (code == -1 && PyErr_Occurred() || PyBytes_AsStringAndSize(PyTuple_GET_ITEM(got, 1), &text, &length) < 0)
        ctx->SetStatus(PythonError("sdp: a malformed status: "));
      else
        ctx->SetStatus(absl::Status(AsCode(static_cast<int>(code)), std::string(text, length)));
      Py_DECREF(got);
      return;
    }
    if (!PyList_Check(got) || PyList_GET_SIZE(got) != ctx->num_outputs()) {
      ctx->SetStatus(absl::InternalError("sdp: the function did not return one array per output"));
      Py_DECREF(got);
      return;
    }
    for (int i = 0; i < ctx->num_outputs(); ++i) Output(ctx, i, PyList_GET_ITEM(got, i));
    Py_DECREF(got);
  }

  void Output(OpKernelContext* ctx, int i, PyObject* obj) {
    PyArrayObject* a = reinterpret_cast<PyArrayObject*>(obj);
    if (!PyArray_Check(obj) || PyArray_TYPE(a) != NumpyType(ctx->expected_output_dtype(i)) ||
        !PyArray_IS_C_CONTIGUOUS(a)) {
      ctx->SetStatus(absl::InternalError("sdp: an output is not a C-contiguous array of its dtype"));
      return;
    }
    tensorflow::TensorShape shape;
    for (int d = 0; d < PyArray_NDIM(a); ++d) shape.AddDim(PyArray_DIM(a, d));
    if (PyArray_SIZE(a) > 0 && reinterpret_cast<uintptr_t>(PyArray_DATA(a)) % EIGEN_MAX_ALIGN_BYTES == 0) {
      NumpyBuffer* buf = new NumpyBuffer(a);  // (shared, no copy)
      ctx->set_output(i, tensorflow::Tensor(ctx->expected_output_dtype(i), shape, buf));
      buf->Unref();
      return;
    }
    tensorflow::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(i, shape, &out));
    if (PyArray_NBYTES(a) > 0) memcpy(const_cast<char*>(out->tensor_data().data()), PyArray_DATA(a), PyArray_NBYTES(a));
  }

  int64_t token_;
};

REGISTER_KERNEL_BUILDER(Name("SdpCall").Device(tensorflow::DEVICE_CPU), SdpCallOp);
#endif  // SDP_CALL

}  // namespace sdp_tf

#ifdef SDP_CALL
// Called through ctypes (with the GIL) by sdp/tensorflow/build_ops.py: SdpCall's functions.
extern "C" void sdp_call_registry(PyObject* mapping) {
  Py_XINCREF(mapping);
  Py_XSETREF(sdp_tf::registry, mapping);
}
#endif

// Called through ctypes by sdp/tensorflow/ops.py (only when a collective failed).
extern "C" {

// The SdpCheck op whose first input is the buffer at `data` fails with (code, message).
void sdp_check_fail(const void* data, int code, const char* message, int64_t length) {
  sdp_tf::Failures& f = sdp_tf::failures();
  std::lock_guard<std::mutex> lock(f.mu);
  auto [it, added] = f.by_buffer.insert_or_assign(data, std::make_pair(code, std::string(message, length)));
  if (added) sdp_tf::pending.fetch_add(1, std::memory_order_release);
}

// 1 while the buffer at `data` is registered (its SdpCheck op has not run), else 0.
int sdp_check_pending(const void* data) {
  sdp_tf::Failures& f = sdp_tf::failures();
  std::lock_guard<std::mutex> lock(f.mu);
  return f.by_buffer.count(data) ? 1 : 0;
}

}  // extern "C"
