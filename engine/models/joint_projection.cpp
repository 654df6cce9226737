// One matrix product for projections whose weights lie end to end. The joined weight is a
// view of their own memory, never a copy in forward: in a shard group of one the unit's
// parameters view its gathered buffer in place (fsdp/unit.cpp), which is where they lie so.
#include "models/joint_projection.h"

#include "models/fp8_product.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

namespace fsdpp {

namespace {

// Whether `weights` [out_i, in] follow one another in memory, in order, with one dtype,
// device and input width.
bool end_to_end(at::TensorList weights) {
  const at::Tensor& first = weights.front();
  const char* next = static_cast<const char*>(first.const_data_ptr());
  for (const auto& w : weights) {
    if (w.dim() != 2 || !w.is_contiguous() || w.scalar_type() != first.scalar_type() ||
        w.device() != first.device() || w.size(1) != first.size(1) || w.const_data_ptr() != next) {
      return false;
    }
    next += w.numel() * w.element_size();
  }
  return true;
}

// The weights as one [Σ out, in] matrix: a view of their memory where they are one block
// (always in forward), else a copy.
at::Tensor joined(at::TensorList weights) {
  if (!end_to_end(weights)) return at::cat(weights);
  int64_t rows = 0;
  for (const auto& w : weights) rows += w.size(0);
  const at::Tensor& first = weights.front();
  return at::from_blob(const_cast<void*>(first.const_data_ptr()), {rows, first.size(1)}, first.options());
}

// x [..., in] times the joined weights transposed -> [..., Σ out]; with `fp8`, the product and
// the input's gradient in float8 as Linear's own (models/fp8_product.h). Backward joins the
// weights again from the parameters themselves, which FSDP frees after forward and gathers
// again for backward as it does any layer's (a joined view kept for backward would outlive
// the memory).
struct JointProjection : public torch::autograd::Function<JointProjection> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, at::TensorList weights,
                            bool fp8) {
    std::vector<at::Tensor> saved{x};
    saved.insert(saved.end(), weights.begin(), weights.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["fp8"] = fp8;
    const at::Tensor weight = joined(weights);  // [Σ out, in]
    if (!fp8) return at::matmul(x, weight.t());  // [..., Σ out]
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    return fp8_forward_product(x.reshape({-1, x.size(-1)}), weight).view(sizes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const std::vector<at::Tensor> weights(saved.begin() + 1, saved.end());
    const at::Tensor& grad = grads[0];  // [..., Σ out]
    torch::autograd::variable_list result(saved.size() + 1);  // the last, fp8's, none
    if (ctx->needs_input_grad(0)) {
      const at::Tensor weight = joined(weights);
      result[0] = ctx->saved_data["fp8"].toBool()
                      ? fp8_input_grad_product(grad.reshape({-1, grad.size(-1)}), weight).view(x.sizes())
                      : at::matmul(grad, weight);  // [..., in]
    }
    bool any_weight = false;
    for (size_t i = 0; i < weights.size(); ++i) any_weight = any_weight || ctx->needs_input_grad(1 + i);
    if (!any_weight) return result;
    // Every weight's gradient from one product, [Σ out, in], split by rows.
    const auto all = grad.reshape({-1, grad.size(-1)}).t().mm(x.reshape({-1, x.size(-1)}));
    int64_t row = 0;
    for (size_t i = 0; i < weights.size(); ++i) {
      if (ctx->needs_input_grad(1 + i)) result[1 + i] = all.narrow(0, row, weights[i].size(0));
      row += weights[i].size(0);
    }
    return result;
  }
};

}  // namespace

torch::Tensor joint_projection(const std::vector<const Linear*>& linears, const torch::Tensor& x) {
  std::vector<at::Tensor> weights;
  for (const Linear* linear : linears) {
    // A hook, an adapter or a bias is the module's own forward to run; so is a product in
    // another precision than the others'.
    if (!linear->calls_forward_alone() || linear->has_adapter() || linear->bias.defined() ||
        linear->fp8_products != linears.front()->fp8_products) {
      return {};
    }
    weights.push_back(linear->weight);
  }
  if (weights.empty() || !end_to_end(weights) || weights.front().scalar_type() != x.scalar_type() ||
      weights.front().device() != x.device() || weights.front().size(1) != x.size(-1)) {
    return {};
  }
  const bool fp8 = linears.front()->fp8_products && x.is_cuda() && x.scalar_type() == at::kBFloat16;
  return JointProjection::apply(x, at::TensorList(weights), fp8);
}

}  // namespace fsdpp
