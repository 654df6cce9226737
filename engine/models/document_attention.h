// Attention over rows that pack several documents, and within a sliding window. A packed row
// must compute what each of its documents would compute alone, as transformers does for packed training with position_ids:
// a token attends only to the earlier tokens of its own document, and RoPE positions restart
// at every document. Rows holding one document each need none of this (causal attention with
// positions 0..T-1 already is that), so an undefined `documents` means plain causal rows.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace fsdpp {

// `documents` [S + 1] int64: the batch read row after row as one sequence of B * T tokens,
// document s holding tokens [documents[s], documents[s + 1]); every row start r * T is among
// the offsets (no document spans two rows) and the last one is B * T. Padding after a row's
// documents is a document of its own, whose targets are none.

// RoPE positions [B, T] int64: each token's distance from the start of its document.
at::Tensor document_positions(const at::Tensor& documents, int64_t batch, int64_t seq_len);

// What each query of a batch may see, built once per forward and handed to every layer as one
// tensor (activation checkpointing recomputes a layer from tensors alone), one of:
//   undefined               plain causal rows: no documents, and no window shorter than them;
//   int32 [S + 1]           `documents` on the device, for the variable-length flash kernel,
//                           which keeps each document to itself without a mask;
//   bool [B or 1, 1, T, T]  a mask, true where a query attends to a key, that restricts
//                           causal attention to each document (a row of one document:
//                           [1, 1, T, T]) and, with `window` > 0, to the last `window` tokens
//                           (a token at t sees t - window + 1 .. t, as Mistral's window does).
// The offsets where that kernel serves the layers: `activations` (the hidden states' dtype and
// device) bf16 or fp16 on a CUDA GPU that runs it (compute capability 8.0 or newer), a
// query/key head size `head_dim` of at most 256 and a multiple of 8, and no window shorter
// than the rows. The mask everywhere else.
at::Tensor attention_scope(const at::Tensor& documents, int64_t window, int64_t batch, int64_t seq_len,
                           const at::TensorOptions& activations, int64_t head_dim);

// Causal attention within `scope` (attention_scope's): query [B, H, T, D], key [B, KV, T, D],
// value [B, KV, T, Dv] with KV dividing H and Dv <= D -> [B, H, T, Dv]. `scale` multiplies the
// logits (default 1 / sqrt(D)). Offsets reaching a layer that computes in fp32 attend through
// the mask of their documents.
at::Tensor scoped_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& scope, std::optional<double> scale = std::nullopt);

}  // namespace fsdpp
