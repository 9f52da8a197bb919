"""What a compiled TensorFlow op calling the engine would save over ``tf.numpy_function`` (issue 30, item 4).

    sdprun -np 2 python benchmarks/tf_call_op.py [--rounds 5] [--iters 500] [--bytes 1024]

sdp's graph collectives are ``tf.numpy_function`` ops.  The alternative is a compiled op whose
kernel calls the same Python function itself: this script builds a minimal one (``SdpBenchCall``,
below: input tensors as read-only numpy views, the function's aligned numpy results as output
tensors without a copy, run inline on the executor's thread) into a temporary directory with
``tf.sysconfig``'s flags, and times, alternately in ``--rounds`` rounds of ``--iters`` calls:

* ``empty``: a ``tf.function`` returning its input (the call's own cost);
* ``numpy_function``: one ``tf.numpy_function`` calling ``f``;
* ``compiled op``: one ``SdpBenchCall`` calling the same ``f``;

where ``f`` is ``sdp.allreduce`` (SUM) of ``--bytes`` of float32.  Rank 0 prints each round's
median (the maximum over ranks) and the median over rounds.  Needs a C++ compiler.
"""
import argparse
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <mutex>
#include <vector>
#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

using namespace tensorflow;
namespace {
std::mutex later_mu;
std::vector<PyObject*>* later = new std::vector<PyObject*>();  // results TensorFlow let go (GIL not held)

class NumpyBuffer : public TensorBuffer {  // an output tensor's memory: a numpy result, held
 public:
  explicit NumpyBuffer(PyArrayObject* a) : TensorBuffer(PyArray_DATA(a)), a_(a), n_(PyArray_NBYTES(a)) {
    Py_INCREF(a);
  }
  ~NumpyBuffer() override { std::lock_guard<std::mutex> l(later_mu); later->push_back((PyObject*)a_); }
  size_t size() const override { return n_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(AllocationDescription* d) const override { d->set_requested_bytes(n_); }
  bool OwnsMemory() const override { return false; }

 private:
  PyArrayObject* a_;
  size_t n_;
};

void release(PyObject* cap) { delete static_cast<Tensor*>(PyCapsule_GetPointer(cap, "tensor")); }
}  // namespace

REGISTER_OP("SdpBenchCall").Attr("token: int").Attr("Tin: list(type) >= 0").Attr("Tout: list(type) >= 0")
    .Input("inputs: Tin").Output("outputs: Tout").SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->UnknownShape());
      return absl::OkStatus();
    });

class SdpBenchCallOp : public OpKernel {
 public:
  explicit SdpBenchCallOp(OpKernelConstruction* c) : OpKernel(c) { OP_REQUIRES_OK(c, c->GetAttr("token", &token_)); }
  bool IsExpensive() override { return false; }
  void Compute(OpKernelContext* ctx) override {
    PyGILState_STATE g = PyGILState_Ensure();
    Run(ctx);
    PyGILState_Release(g);
  }

 private:
  void Run(OpKernelContext* ctx) {
    std::vector<PyObject*> drop;
    { std::lock_guard<std::mutex> l(later_mu); drop.swap(*later); }
    for (PyObject* o : drop) Py_DECREF(o);
    static bool numpy = _import_array() >= 0;
    PyObject* m = PyImport_ImportModule("__main__");
    PyObject* calls = m ? PyObject_GetAttrString(m, "CALLS") : nullptr;
    Py_XDECREF(m);
    PyObject* fn = calls && numpy ? PyList_GetItem(calls, token_) : nullptr;
    Py_XDECREF(calls);
    if (!fn) { PyErr_Clear(); ctx->SetStatus(absl::InternalError("no function")); return; }
    PyObject* args = PyTuple_New(ctx->num_inputs());
    for (int i = 0; i < ctx->num_inputs(); ++i) {
      const Tensor& t = ctx->input(i);
      npy_intp dims[8];
      for (int d = 0; d < t.dims(); ++d) dims[d] = t.dim_size(d);
      PyObject* a = PyArray_New(&PyArray_Type, t.dims(), dims, NPY_FLOAT32, nullptr,
                                const_cast<char*>(t.tensor_data().data()), 0, NPY_ARRAY_CARRAY_RO, nullptr);
      PyArray_SetBaseObject((PyArrayObject*)a, PyCapsule_New(new Tensor(t), "tensor", release));
      PyTuple_SET_ITEM(args, i, a);
    }
    PyObject* res = PyObject_Call(fn, args, nullptr);
    Py_DECREF(args);
    if (!res) { PyErr_Print(); ctx->SetStatus(absl::InternalError("the function raised")); return; }
    for (int i = 0; i < ctx->num_outputs(); ++i) {
      PyArrayObject* a = (PyArrayObject*)PyList_GetItem(res, i);
      TensorShape shape;
      for (int d = 0; d < PyArray_NDIM(a); ++d) shape.AddDim(PyArray_DIM(a, d));
      NumpyBuffer* buf = new NumpyBuffer(a);
      ctx->set_output(i, Tensor(ctx->expected_output_dtype(i), shape, buf));
      buf->Unref();
    }
    Py_DECREF(res);
  }
  int64_t token_;
};
REGISTER_KERNEL_BUILDER(Name("SdpBenchCall").Device(DEVICE_CPU), SdpBenchCallOp);
"""

CALLS = []  # token -> the Python function an SdpBenchCall op calls (the kernel reads __main__.CALLS)


def build(tmp: Path) -> Path:
    import tensorflow as tf
    src, out = tmp / "call.cc", tmp / "call.so"
    src.write_text(SOURCE)
    cmd = [os.environ.get("CXX", "g++"), "-shared", "-fPIC", "-O2", "-Wno-deprecated-declarations", str(src), "-o",
           str(out), f"-I{np.get_include()}", f"-I{sysconfig.get_paths()['include']}",
           *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--bytes", type=int, default=1024)
    args = p.parse_args(argv)
    import tensorflow as tf

    import sdp
    import sdp.tensorflow
    sdp.tensorflow.init()  # (TensorFlow's threads set as for training: not spinning with several ranks a host)
    with tempfile.TemporaryDirectory() as tmp:
        lib = tf.load_op_library(str(build(Path(tmp))))
    x = tf.constant(np.ones(args.bytes // 4, np.float32))

    def f(a):
        return sdp.allreduce(a, name="bench.call", op=sdp.Sum)

    CALLS.append(lambda a: [f(a)])
    fns = {"empty": tf.function(lambda t: t),
           "numpy_function": tf.function(lambda t: tf.numpy_function(f, [t], tf.float32, stateful=True)),
           "compiled op": tf.function(lambda t: lib.sdp_bench_call([t], token=0, Tout=[tf.float32])[0])}
    want = np.full(x.shape, float(sdp.size()), np.float32)
    for name, fn in fns.items():
        for _ in range(100):
            got = fn(x)
        assert name == "empty" or np.array_equal(got.numpy(), want), name
    rounds = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            sdp.barrier()
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                fn(x)
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            rounds[name].append(float(sdp.allreduce(np.array([med]), name=f"bench.{name}", op=sdp.Max)[0]))
    if sdp.rank() == 0:
        print(f"a tf.function of one {args.bytes} B allreduce, {sdp.size()} ranks, us (each round's median, "
              f"max over ranks; {args.rounds} rounds of {args.iters} calls):")
        for name, vals in rounds.items():
            print(f"  {name:<16} median {statistics.median(vals) * 1e6:8.1f}   rounds "
                  + " ".join(f"{v * 1e6:.1f}" for v in vals))
        saved = statistics.median(rounds["numpy_function"]) - statistics.median(rounds["compiled op"])
        print(f"  the compiled op saves {saved * 1e6:.1f} us per call over numpy_function")
    sdp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
