// The training objective: summed next-token cross entropy. On a GPU with float32, bf16 or
// fp16 logits it runs as one fused kernel each way (loss/cross_entropy_kernel), which keeps
// no float32 copy of the logits and saves the logits themselves for backward rather than
// their float32 log-softmax; elsewhere as ATen's cross entropy on logits widened to float32,
// as transformers widens them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace fsdpp {

// The target of a token that is not predicted (transformers' ignore_index): padding, prompts
// under train_on = "completion", a row's last token.
constexpr int64_t kIgnoredTarget = -100;

// Summed cross entropy, in float32 (float64 for float64 logits), of logits [B, T, V] against
// targets [B, T]; a target of kIgnoredTarget counts for nothing.
at::Tensor next_token_loss_sum(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace fsdpp
