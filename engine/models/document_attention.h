// Attention over rows that pack several documents, and within a sliding window. A packed row
// must compute what each of its documents would compute alone, as transformers does for packed training with position_ids:
// a token attends only to the earlier tokens of its own document, and RoPE positions restart
// at every document. Rows holding one document each need none of this (causal attention with
// positions 0..T-1 already is that), so an undefined `documents` means plain causal rows.
#pragma once

#include <ATen/core/Tensor.h>

namespace fsdpp {

// `documents` [S + 1] int64: the batch read row after row as one sequence of B * T tokens,
// document s holding tokens [documents[s], documents[s + 1]); every row start r * T is among
// the offsets (no document spans two rows) and the last one is B * T. Padding after a row's
// documents is a document of its own, whose targets are none.

// RoPE positions [B, T] int64: each token's distance from the start of its document.
at::Tensor document_positions(const at::Tensor& documents, int64_t batch, int64_t seq_len);

// The mask that restricts causal attention to each document (undefined `documents`: each
// row is one) and, with `window` > 0, to the last `window` tokens (a token at t sees
// t - window + 1 .. t, as Mistral's sliding window does): [B, 1, T, T] bool, true where a query
// attends to a key (a row of one document: [1, 1, T, T]). Undefined where plain causal
// attention already is that: no documents, and no window shorter than the rows. Built once
// per forward and shared by every layer.
at::Tensor restricted_causal_mask(const at::Tensor& documents, int64_t window, int64_t batch, int64_t seq_len,
                                  const at::Device& device);

}  // namespace fsdpp
