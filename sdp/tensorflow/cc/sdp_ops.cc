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
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

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

}  // namespace sdp_tf

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
