// The checks of the tensors a Python loop hands the run: each refused with one line naming the
// argument, before the run reads it.
#pragma once

#include "models/causal_lm.h"
#include "models/model_config.h"
#include "run/sampling.h"

#include <ATen/core/Tensor.h>

#include <map>
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

// A generation's attention mask [B, T] (1 a token, 0 padding) of `ids` [B, T] as `kept` bool,
// each row padded on the left alone and holding a token; and its options checked against the
// vocabulary of `vocab` tokens. UserError naming the argument as `names` says (an option's name
// -> where it came from; one not listed is named as itself).
at::Tensor checked_generation(const at::Tensor& ids, const std::optional<at::Tensor>& attention_mask,
                              const GenerationOptions& options, int64_t vocab,
                              const std::map<std::string, std::string>& names);

// The images and videos of `ids` [B, T] laid out as `layout` says, from the tensors a loop
// passes by transformers' names (pixel_values [N, C * Tt * P * P], image_grid_thw [I, 3] int64,
// pixel_values_videos, video_grid_thw, second_per_grid_ts [V], and mm_token_type_ids [B, T],
// which must say what the placeholders say; none given: the rows are text), checked against the model's vision tower, the grids and the rows' placeholders; UserError
// naming the argument. A vision-language model's rows are checked even with none given (their
// placeholders need grids), and take no position_ids: the model places its tokens itself.
VisionInputs checked_vision(const ModelConfig& model, const at::Tensor& ids, const RowLayout& layout,
                            const std::map<std::string, at::Tensor>& given);

}  // namespace fsdpp
