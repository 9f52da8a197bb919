// sdp's compiled TensorFlow op, built by `python -m sdp.tensorflow.build_ops` (or on first use)
// and used by sdp/tensorflow/ops.py.
//
// SdpCheck gives a graph collective's failure TensorFlow's status code.  sdp's collectives in
// graphs are tf.numpy_function ops, and TensorFlow turns an exception raised in one into a status
// by its Python class only (ValueError -> INVALID_ARGUMENT).  So sdp's numpy_function returns its
// results plus a status instead of raising, and one SdpCheck op, fed all of them, fails with that
// status (FAILED_PRECONDITION for ranks that disagree, as Horovod's kernels) or forwards the
// results without a copy.
#include <cstdint>
#include <string>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace sdp_tf {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::shape_inference::InferenceContext;

// tensors: one collective op's results (placeholders of the right dtypes when it failed).
// status: uint8, empty when the collective succeeded; else byte 0 is an absl::StatusCode and the
// rest sdp's message (UTF-8).  A code outside absl's range becomes UNKNOWN.
REGISTER_OP("SdpCheck")
    .Attr("T: list(type) >= 0")
    .Input("tensors: T")
    .Input("status: uint8")
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
    const tensorflow::Tensor& status = ctx->input(n);
    const int64_t len = status.NumElements();
    if (len > 0) {
      const uint8_t* bytes = status.flat<uint8_t>().data();
      const int code = bytes[0];
      const bool known = code > 0 && code <= static_cast<int>(absl::StatusCode::kUnauthenticated);
      ctx->SetStatus(absl::Status(known ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown,
                                  std::string(reinterpret_cast<const char*>(bytes + 1), len - 1)));
      return;
    }
    for (int i = 0; i < n; ++i) ctx->set_output(i, ctx->input(i));  // shares the buffers
  }
};

REGISTER_KERNEL_BUILDER(Name("SdpCheck").Device(tensorflow::DEVICE_CPU), SdpCheckOp);

}  // namespace sdp_tf
