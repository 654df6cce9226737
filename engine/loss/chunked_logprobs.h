// Per-token log-probabilities under the output head, computed a chunk of tokens at a time:
// log softmax(h W^T / temperature)[target] for hidden states h [N, C] and head W [V, C],
// without ever holding the [N, V] logits (an RL loop's log-probabilities of a 150k
// vocabulary would otherwise take N × V × 4 bytes); and, where asked, each token's entropy
// of that softmax, the bonus an RL loss adds. Backward recomputes each chunk's logits and
// gives the gradient of the full computation.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace fsdpp {

struct TokenLogprobs {
  at::Tensor logprobs;  // [N]
  at::Tensor entropy;   // [N] -sum_v p_v log p_v; undefined unless asked for
};

// hidden [N, C], weight [V, C], targets [N] int64 in [0, V) -> [N] each, in float32 (float64
// for float64 hidden states); differentiable in hidden and weight. `chunk_tokens` tokens'
// logits are live at a time.
TokenLogprobs chunked_logprobs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                               double temperature, int64_t chunk_tokens, bool with_entropy = false);

}  // namespace fsdpp
