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
  // video, in order -> logits [B, T, V].
  torch::Tensor forward(const torch::Tensor& input_ids, const VisionInputs& vision) override;

  // Multimodal RoPE positions [3, B, T]: text tokens count up on all three axes; a vision
  // block's tokens take (frame, row, column) offsets from where the text stopped (Qwen2.5-VL
  // spaces a video's frames by seconds × tokens_per_second), and the text after it resumes
  // past the block's largest position.
  torch::Tensor position_ids(const torch::Tensor& input_ids, const VisionInputs& vision) const;

 private:
  std::shared_ptr<VisionTransformer> visual_;
  std::shared_ptr<DecoderModel> model_;
  std::shared_ptr<Linear> lm_head_;
};

}  // namespace fsdpp
