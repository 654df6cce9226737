// Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration,
// Qwen2_5_VLForConditionalGeneration): the vision tower ("visual"), a Qwen2 decoder ("model")
// whose RoPE is multimodal (each token has a temporal, row and column position), and
// lm_head. Image and video features replace their placeholder tokens' embeddings.
#pragma once

#include "models/causal_lm.h"
#include "models/decoder.h"
#include "models/vision.h"

namespace fsdpp {

class VisionLanguageLM : public CausalLM {
 public:
  VisionLanguageLM(const ModelConfig& config, const torch::TensorOptions& opts);
  FSDPP_MODULE_CALL
  torch::Tensor forward(const torch::Tensor& input_ids) override;  // text only: [B, T] -> [B, T, V]
  // input_ids [B, T] holding one placeholder token per merged patch group of each image and
  // video, in order, in rows laid out as `layout` says (documents; positions of the caller's
  // choosing are refused: this model places its tokens itself) -> logits [B, T, V].
  torch::Tensor forward(const torch::Tensor& input_ids, const VisionInputs& vision, const RowLayout& layout) override;
  torch::Tensor forward(const torch::Tensor& input_ids, const RowLayout& layout) override;  // text only
  torch::Tensor forward(const torch::Tensor& input_ids, const FinalHidden& ask) override;
  // A generation's step: the first places the prompt's tokens as position_ids does (each row's
  // padding apart) and moves the later steps' text past its images, as transformers does.
  torch::Tensor forward(const torch::Tensor& input_ids, const GenerationStep& step) override;
  KvCache generation_cache(int64_t capacity) const override;
  torch::Tensor output_head_weight() const override { return lm_head_->weight; }
  bool output_head_adapted() const override { return lm_head_->has_adapter(); }

  // Multimodal RoPE positions [3, B, T]: text tokens count up on all three axes; a vision
  // block's tokens take (frame, row, column) offsets from where the text stopped (Qwen2.5-VL
  // spaces a video's frames by seconds × tokens_per_second), and the text after it resumes
  // past the block's largest position. Each of `documents` (as RowLayout::offsets; undefined:
  // one per row) counts from 0, as if alone.
  torch::Tensor position_ids(const torch::Tensor& input_ids, const VisionInputs& vision,
                             const torch::Tensor& documents = {}) const;

 private:
  // The final hidden states [B, T, C] of input_ids with `vision` in rows laid out as `layout` says.
  torch::Tensor hidden(const torch::Tensor& input_ids, const VisionInputs& vision, const RowLayout& layout);
  // The token embeddings [B, T, C] with the vision features in place of their placeholders;
  // with `generated`, the tokens a generation drew, whose placeholders (if drawn) are text.
  torch::Tensor embeddings(const torch::Tensor& input_ids, const VisionInputs& vision, bool generated = false);

  std::shared_ptr<VisionTransformer> visual_;
  std::shared_ptr<DecoderModel> model_;
  std::shared_ptr<Linear> lm_head_;
};

}  // namespace fsdpp
