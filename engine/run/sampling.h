// How a generation picks each next token from the logits: the most likely one, or a draw from
// the softmax at a temperature, cut to the top k tokens and to the nucleus of top_p mass, as
// transformers' generate does.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace fsdpp {

struct GenerationOptions {
  int64_t max_new_tokens = 32;  // tokens added to each row at most
  double temperature = 1.0;     // divides the logits; 0: the most likely token (greedy)
  int64_t top_k = 0;            // draw among the k most likely tokens; 0: all
  double top_p = 1.0;           // draw among the most likely tokens holding this much mass; 1: all
  std::vector<int64_t> eos;     // a row ends after any of these
  int64_t pad = 0;              // what a row holds after its end
};

// The next token [B] int64 of each row from its logits [B, V]; draws use the default
// generator of the logits' device, which torch.manual_seed sets.
at::Tensor next_tokens(const at::Tensor& logits, const GenerationOptions& options);

}  // namespace fsdpp
