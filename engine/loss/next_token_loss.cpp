// Next-token cross entropy, fused on a GPU (a custom autograd function over
// loss/cross_entropy_kernel) or ATen's.
#include "loss/next_token_loss.h"

#include <ATen/ATen.h>

#ifdef FSDPP_CUDA_KERNELS
#include "loss/cross_entropy_kernel.h"
#include "models/kernel_element.h"

#include <torch/csrc/autograd/custom_function.h>
#endif

namespace fsdpp {

#ifdef FSDPP_CUDA_KERNELS
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Per-row losses [N] in float32 of logits [N, V] against targets [N] (int64, on the logits'
// device). Backward needs the logits as they are and each row's log-sum-exp.
struct FusedCrossEntropy : public torch::autograd::Function<FusedCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets) {
    const auto x = logits.contiguous();
    const auto t = targets.contiguous();
    const auto row_options = x.options().dtype(at::kFloat);
    auto loss = at::empty({x.size(0)}, row_options), lse = at::empty({x.size(0)}, row_options);
    at::RecordFunction record(at::RecordScope::FUNCTION);
    if (record.isActive()) describe_kernel(record, "fsdpp::cross_entropy_forward", {x, t}, {loss, lse});
    kernels::cross_entropy_forward(*kernel_element(x), x.get_device(), x.const_data_ptr(), t.const_data_ptr<int64_t>(),
                                   kIgnoredTarget, loss.mutable_data_ptr<float>(), lse.mutable_data_ptr<float>(),
                                   x.size(0), x.size(1));
    ctx->save_for_backward({x, t, lse});
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    TORCH_CHECK(!at::GradMode::is_enabled(), "the fused cross entropy has no second derivative");
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto grad_loss = grads[0].to(at::kFloat).contiguous();  // [N]; a sum's gradient arrives expanded
    auto grad = at::empty_like(x);
    at::RecordFunction record(at::RecordScope::FUNCTION);
    if (record.isActive()) {
      describe_kernel(record, "fsdpp::cross_entropy_backward", {x, saved[1], saved[2], grad_loss}, {grad});
    }
    kernels::cross_entropy_backward(*kernel_element(x), x.get_device(), x.const_data_ptr(),
                                    saved[1].const_data_ptr<int64_t>(), kIgnoredTarget,
                                    saved[2].const_data_ptr<float>(), grad_loss.const_data_ptr<float>(),
                                    grad.mutable_data_ptr(), x.size(0), x.size(1));
    return {grad, at::Tensor()};
  }
};

}  // namespace
#endif

at::Tensor next_token_loss_sum(const at::Tensor& logits, const at::Tensor& targets) {
  const int64_t vocab = logits.size(-1);
  const auto rows = logits.reshape({-1, vocab});  // [N, V]
  const auto row_targets = targets.reshape({-1});  // [N]
#ifdef FSDPP_CUDA_KERNELS
  if (kernel_element(rows) && row_targets.scalar_type() == at::kLong && row_targets.device() == rows.device() &&
      row_targets.size(0) == rows.size(0)) {
    return FusedCrossEntropy::apply(rows, row_targets).sum();
  }
#endif
  // At least float32; a float64 model's loss stays float64.
  const auto dtype = at::promote_types(logits.scalar_type(), at::kFloat);
  return at::cross_entropy_loss(rows.to(dtype), row_targets, /*weight=*/{}, at::Reduction::Sum, kIgnoredTarget);
}

}  // namespace fsdpp
