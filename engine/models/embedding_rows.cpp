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

// The rows of each distinct token of `ids` [N] summed in the order the tokens came (a stable
// sort; in float32 for bf16 and fp16 rows): the tokens [N] and their sums [N, C], the U
// distinct ones first, then tokens 0 with sums of zeros. N rows rather than U, so that nothing
// reads U back to the host (a wait for the device); the zeros added to row 0 change nothing,
// in any order. index_add_ of the U distinct tokens touches each element once, so no two of
// their additions race on a GPU.
std::pair<at::Tensor, at::Tensor> sums_by_token(const at::Tensor& ids, const at::Tensor& rows) {
  const int64_t N = ids.size(0);
  const auto [sorted, order] = at::sort(ids, /*stable=*/std::optional<bool>(true), /*dim=*/0);  // [N] each
  // Which distinct token each sorted row belongs to: a count of where the token changes.
  const auto run = at::zeros({N}, sorted.options());  // [N]
  at::Tensor after_first = run.narrow(0, 1, N - 1);    // [N - 1]
  at::cumsum_out(after_first, sorted.narrow(0, 1, N - 1).ne(sorted.narrow(0, 0, N - 1)), 0);
  const auto lengths = at::zeros({N}, sorted.options()).scatter_add_(0, run, at::ones_like(run));  // [N]
  const auto distinct = at::zeros({N}, sorted.options()).scatter_(0, run, sorted);                  // [N]
  // Lengths sum to N by construction: the unchecked form skips the check's read back.
  auto sums = at::segment_reduce(rows.index_select(0, order).to(at::toOpMathType(rows.scalar_type())), "sum",
                                 lengths, /*indices=*/{}, /*offsets=*/{}, /*axis=*/0, /*unsafe=*/true,
                                 /*initial=*/0);  // [N, C]
  return {distinct, sums};
}

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
    at::NoGradGuard no_grad;
    if (!weight.grad().defined()) weight.mutable_grad() = at::zeros_like(weight, at::MemoryFormat::Contiguous);
    if (ids.numel() == 0) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const auto [distinct, sums] = sums_by_token(ids, rows);  // [N], [N, C]
    if (const int64_t padding_row = ctx->saved_data["padding_row"].toInt(); padding_row >= 0) {
      sums.masked_fill_((distinct == padding_row).unsqueeze(1), 0);
    }
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
