// The next-token loss: ATen's cross entropy widened to float32 on the host, and the fused CUDA
// kernel against the loss and gradient written out in float64, for float32, bf16 and fp16
// logits, rows of whole 16-byte packs and rows of single elements, with ignored targets, a row
// beyond float32's exp and rows led by their first or last element.
#include "loss/next_token_loss.h"

#include "tensor_checks.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

using namespace fsdpp;

namespace {

// Summed log-sum-exp minus the target's logit in float64, over rows whose target is not -100.
at::Tensor loss_reference(const at::Tensor& logits, const at::Tensor& targets) {
  const auto wide = logits.to(at::kDouble);
  const auto counted = targets != -100;
  const auto safe = targets.masked_fill(~counted, 0).unsqueeze(-1);
  const auto per_row = at::logsumexp(wide, -1) - wide.gather(-1, safe).squeeze(-1);
  return per_row.masked_fill(~counted, 0).sum();
}

// Targets [B, T] over `vocab` with the first and last token ids and two ignored rows.
at::Tensor targets_for(int64_t vocab) {
  auto targets = at::randint(0, vocab, {3, 7}, at::kLong);
  targets[1][0] = 0;
  targets[1][1] = vocab - 1;
  targets[0][2] = -100;
  targets[2][6] = -100;
  return targets;
}

}  // namespace

TEST_CASE("the host loss is cross entropy on logits widened to float32, ignoring -100", "[train]") {
  at::manual_seed(11);
  const auto targets = targets_for(50);
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    INFO(dtype);
    const auto logits = at::randn({3, 7, 50}).mul(4).to(dtype);
    const auto loss = next_token_loss_sum(logits, targets);
    CHECK(loss.scalar_type() == at::kFloat);
    CHECK(relative_error(loss.to(at::kDouble), loss_reference(logits, targets)) < kernel_bound(at::kFloat));
  }
}

TEST_CASE("the fused cross entropy kernel gives the float32 loss and its gradient", "[train][gpu]") {
  if (!gpu_half_runs()) return;
  const auto dtype = GENERATE(at::kFloat, at::kBFloat16, at::kHalf);
  // Rows of single elements; rows of whole 16-byte packs, each thread taking several.
  const int64_t vocab = GENERATE(1001, 32000);
  INFO(dtype << ", vocabulary " << vocab);
  at::manual_seed(13);
  const auto targets = targets_for(vocab);
  auto logits_before_rounding = at::randn({3, 7, vocab}, at::kDouble).mul(4);
  logits_before_rounding[0][0] += 100;  // exp overflows float32: the row's maximum must come out first
  logits_before_rounding[1][2][0] = 30;  // a row's first and a row's last element dominate it,
  logits_before_rounding[1][3][vocab - 1] = 30;  // so leaving either out shows
  // The reference starts from the logits as rounded to dtype; widening them is exact.
  const auto values = logits_before_rounding.to(dtype).to(at::kDouble);
  const double scale = 0.37;  // the gradient reaching the loss, as a mean's divisor makes it
  auto reference_logits = values.clone().requires_grad_(true);
  const auto expected = loss_reference(reference_logits, targets);
  (expected * scale).backward();

  auto logits = values.to(at::TensorOptions(dtype).device(at::kCUDA)).requires_grad_(true);
  const auto loss = next_token_loss_sum(logits, targets.cuda());
  (loss * scale).backward();
  CHECK(loss.scalar_type() == at::kFloat);
  // Float32 math on exact inputs: the loss holds float32's accuracy whatever the logits' type.
  CHECK(relative_error(loss.to(at::kCPU, at::kDouble), expected.detach()) < kernel_bound(at::kFloat));
  const auto grad = logits.grad().to(at::kCPU, at::kDouble);
  CHECK(relative_error(grad, reference_logits.grad()) < kernel_bound(dtype));
  CHECK(grad[0][2].abs().max().item<double>() == 0.0);  // an ignored row
  CHECK(backward_runs(loss, "FusedCrossEntropy"));
}
