// Greedy choice, temperature, top-k and top-p over a step's logits.
#include "run/sampling.h"

#include <ATen/ATen.h>

#include <limits>

namespace fsdpp {

at::Tensor next_tokens(const at::Tensor& logits, const GenerationOptions& options) {
  if (options.temperature == 0.0) return logits.argmax(-1);
  // Reduced-precision logits are widened: a bf16 softmax's rounding would skew the draw.
  at::Tensor scores = (at::isReducedFloatingType(logits.scalar_type()) ? logits.to(at::kFloat) : logits) /
                      options.temperature;  // [B, V]
  const double removed = -std::numeric_limits<double>::infinity();
  const int64_t vocab = scores.size(-1);
  if (options.top_k > 0 && options.top_k < vocab) {
    const at::Tensor kth = std::get<0>(scores.topk(options.top_k, -1)).narrow(-1, options.top_k - 1, 1);  // [B, 1]
    scores = scores.masked_fill(scores < kth, removed);
  }
  if (options.top_p < 1.0) {
    const auto [sorted, order] = scores.sort(-1, /*descending=*/true);  // [B, V] each
    const at::Tensor probabilities = sorted.softmax(-1);
    // A token stays while the mass of the more likely ones before it is short of top_p: the
    // smallest set holding top_p, the most likely token always among it.
    const at::Tensor before = probabilities.cumsum(-1) - probabilities;
    scores = scores.scatter(-1, order, sorted.masked_fill(before >= options.top_p, removed));
  }
  return at::multinomial(scores.softmax(-1), 1).squeeze(-1);
}

}  // namespace fsdpp
