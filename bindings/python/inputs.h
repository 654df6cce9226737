// The checks of the tensors a Python loop hands the run: each refused with one line naming the
// argument, before the run reads it.
#pragma once

#include "models/causal_lm.h"

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace fsdpp {

// "[2, 16]": a tensor's shape, as messages print it.
std::string shape_text(const at::Tensor& t);

// `ids` [batch, tokens] int64 of a vocabulary of `vocab` tokens, or UserError naming `what`.
void check_token_ids(const std::string& what, const at::Tensor& ids, int64_t vocab);

// logprobs' `input_ids` and `targets` [B, T] int64 and its temperature, or UserError naming
// the argument.
void check_logprobs_inputs(const at::Tensor& input_ids, const at::Tensor& targets, double temperature, int64_t vocab);

// The rows' layout from `position_ids` [B, T] int64 (each token's RoPE position) and
// `document_offsets` [S + 1] int64 (documents packed into the rows, never across a row's end),
// checked against `ids` [B, T].
RowLayout checked_layout(const at::Tensor& ids, const std::optional<at::Tensor>& position_ids,
                         const std::optional<at::Tensor>& document_offsets);

}  // namespace fsdpp
