// The residual add and RMSNorm, as one custom autograd function over the fused kernels or as
// an add and the norm's own call.
#include "models/residual_norm.h"

#include <ATen/ATen.h>

#ifdef FSDPP_CUDA_KERNELS
#include "models/kernel_element.h"

#include <torch/csrc/autograd/custom_function.h>
#endif

namespace fsdpp {

namespace {

#ifdef FSDPP_CUDA_KERNELS
// Saves the sum and each row's 1/rms, as ATen's norm saves its input and 1/rms.
struct FusedAddRMSNorm : public torch::autograd::Function<FusedAddRMSNorm> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& delta, const at::Tensor& weight, double eps) {
    const auto a = x.contiguous(), b = delta.contiguous(), w = weight.contiguous();
    const int64_t width = a.size(-1), rows = a.numel() / width;
    auto sum = at::empty_like(a), out = at::empty_like(a);
    auto rstd = at::empty({rows}, a.options().dtype(at::kFloat));  // [rows]
    at::RecordFunction record(at::RecordScope::FUNCTION);
    if (record.isActive()) describe_kernel(record, "fsdpp::add_rms_norm_forward", {a, b, w}, {sum, out, rstd});
    kernels::add_rms_norm_forward(*kernel_element(a), a.get_device(), a.const_data_ptr(), b.const_data_ptr(),
                                  w.const_data_ptr(), sum.mutable_data_ptr(), out.mutable_data_ptr(),
                                  rstd.mutable_data_ptr<float>(), rows, width, static_cast<float>(eps));
    ctx->save_for_backward({sum, w, rstd});
    // A sum nobody reads further (or a norm nobody reads) sends no gradient: nothing to read.
    ctx->set_materialize_grads(false);
    return {sum, out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto& grad_sum = grads[0];
    if (!grads[1].defined()) return {grad_sum, grad_sum, at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    const auto& sum = saved[0];
    const auto& weight = saved[1];
    const auto& rstd = saved[2];
    const auto dy = grads[1].contiguous();
    const auto gs = grad_sum.defined() ? grad_sum.contiguous() : at::Tensor();
    const int64_t width = sum.size(-1), rows = sum.numel() / width;
    auto grad_x = at::empty_like(sum);
    at::Tensor partials;  // [blocks, width] float32
    if (ctx->needs_input_grad(2)) {
      partials = at::empty({kernels::add_rms_norm_backward_blocks(sum.get_device(), rows), width},
                           sum.options().dtype(at::kFloat));
    }
    {
      at::RecordFunction record(at::RecordScope::FUNCTION);
      if (record.isActive()) {
        describe_kernel(record, "fsdpp::add_rms_norm_backward", {dy, gs, sum, weight, rstd}, {grad_x, partials});
      }
      kernels::add_rms_norm_backward(*kernel_element(sum), sum.get_device(), dy.const_data_ptr(),
                                     gs.defined() ? gs.const_data_ptr() : nullptr, sum.const_data_ptr(),
                                     weight.const_data_ptr(), rstd.const_data_ptr<float>(), grad_x.mutable_data_ptr(),
                                     partials.defined() ? partials.mutable_data_ptr<float>() : nullptr, rows, width);
    }
    const auto grad_weight = partials.defined() ? partials.sum(0).to(weight.scalar_type()) : at::Tensor();
    return {grad_x, grad_x, grad_weight, at::Tensor()};
  }
};

bool fused_kernel_takes(const at::Tensor& x, const at::Tensor& delta, const RMSNorm& norm) {
  return kernel_element(x) && norm.calls_forward_alone() && delta.scalar_type() == x.scalar_type() &&
         norm.weight.scalar_type() == x.scalar_type() && delta.sizes() == x.sizes() && delta.device() == x.device() &&
         norm.weight.device() == x.device() && x.dim() >= 1 && x.size(-1) == norm.weight.numel() &&
         x.size(-1) <= kernels::kMaxNormWidth && x.numel() > 0;
}
#endif

}  // namespace

ResidualNorm add_then_norm(const torch::Tensor& x, const torch::Tensor& delta, RMSNorm& norm) {
#ifdef FSDPP_CUDA_KERNELS
  if (fused_kernel_takes(x, delta, norm)) {
    auto outputs = FusedAddRMSNorm::apply(x, delta, norm.weight, norm.eps);
    return {.sum = outputs[0], .normed = outputs[1]};
  }
#endif
  auto sum = x + delta;
  return {.sum = sum, .normed = norm(sum)};
}

}  // namespace fsdpp
