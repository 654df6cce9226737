// The embedding lookup that adds its gradient into the weight's .grad in place.
#include "models/embedding_rows.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <torch/csrc/autograd/custom_function.h>

namespace fsdpp {

namespace {

// The weight whose .grad backward fills, passed as a value autograd does not trace: a tensor
// argument would give the node an edge to the weight's accumulator.
struct GradTarget {
  at::Tensor weight;
};

// The lookup's one differentiable input is `anchor`, an alias of the weight made for this call
// alone: its gradient edge leads nowhere, so autograd neither waits for this node before
// accumulating lm_head's gradient into the weight nor adds a [V, C] tensor of its own.
struct EmbeddingRows : public torch::autograd::Function<EmbeddingRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& anchor, GradTarget target,
                            const at::Tensor& ids, int64_t padding_row) {
    ctx->saved_data["weight"] = target.weight;
    ctx->saved_data["ids"] = ids;
    ctx->saved_data["padding_row"] = padding_row;
    return at::embedding(anchor, ids);  // [..., C]
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    at::Tensor weight = ctx->saved_data["weight"].toTensor();  // [V, C]
    const at::Tensor ids = ctx->saved_data["ids"].toTensor().reshape({-1});  // [N]
    const at::Tensor rows = grads[0].reshape({-1, weight.size(1)});  // [N, C]
    // Each distinct token's rows summed in the order the tokens came (a stable sort), then
    // added once: index_add_ of distinct indices touches every element once, so no two
    // additions race on a GPU.
    const auto [sorted, order] = at::sort(ids, /*stable=*/std::optional<bool>(true), /*dim=*/0);
    const auto [distinct, inverse, counts] =
        at::unique_consecutive(sorted, /*return_inverse=*/false, /*return_counts=*/true);
    auto sums = at::segment_reduce(rows.index_select(0, order).to(at::toOpMathType(rows.scalar_type())), "sum",
                                   counts);  // [U, C]
    at::NoGradGuard no_grad;
    if (const int64_t padding_row = ctx->saved_data["padding_row"].toInt(); padding_row >= 0) {
      sums.masked_fill_((distinct == padding_row).unsqueeze(1), 0);
    }
    if (!weight.grad().defined()) weight.mutable_grad() = at::zeros_like(weight, at::MemoryFormat::Contiguous);
    weight.mutable_grad().index_add_(0, distinct, sums.to(weight.grad().scalar_type()));
    return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor embedding_rows(const at::Tensor& weight, const at::Tensor& ids, int64_t padding_row) {
  if (!weight.requires_grad() || !at::GradMode::is_enabled()) return at::embedding(weight, ids);
  return EmbeddingRows::apply(weight.detach().requires_grad_(true), GradTarget{weight}, ids, padding_row);
}

}  // namespace fsdpp
