// Positions and masks for packed documents and sliding windows: a block-diagonal, banded
// causal mask for ATen's fused attention, on every device.
#include "models/document_attention.h"

#include <ATen/ATen.h>

namespace fsdpp {

namespace {

// The document each token belongs to: [B * T] int64, from the offsets without a host sync
// (the output size is known, so repeat_interleave needs not read the lengths back).
at::Tensor document_of_token(const at::Tensor& documents, int64_t tokens) {
  const int64_t S = documents.size(0) - 1;
  auto lengths = documents.narrow(0, 1, S) - documents.narrow(0, 0, S);  // [S]
  return at::repeat_interleave(at::arange(S, documents.options()), lengths, 0, tokens);
}

}  // namespace

at::Tensor document_positions(const at::Tensor& documents, int64_t batch, int64_t seq_len) {
  const int64_t tokens = batch * seq_len;
  auto owner = document_of_token(documents, tokens);  // [B * T]
  return (at::arange(tokens, documents.options()) - documents.index_select(0, owner)).view({batch, seq_len});
}

at::Tensor restricted_causal_mask(const at::Tensor& documents, int64_t window, int64_t batch, int64_t seq_len,
                                  const at::Device& device) {
  const int64_t T = seq_len;
  if (window >= T) window = 0;  // a window no shorter than the rows restricts nothing
  if (!documents.defined() && window == 0) return {};
  // Each token always sees itself, so no row of the mask is empty (an empty one would give
  // NaN through the softmax); padding attends to padding alone.
  auto mask = at::ones({T, T}, at::TensorOptions(at::kBool).device(device)).tril();  // [T, T]
  if (window > 0) mask = mask.triu(1 - window);  // key j of query i: i - window < j <= i
  mask = mask.unsqueeze(0);                       // [1, T, T]
  if (documents.defined()) {
    auto owner = document_of_token(documents.to(device), batch * T).view({batch, T});  // [B, T]
    mask = mask & (owner.unsqueeze(2) == owner.unsqueeze(1));                        // [B, T, T]
  }
  return mask.unsqueeze(1);  // [B, 1, T, T]
}

}  // namespace fsdpp
