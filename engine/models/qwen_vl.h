// Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration,
// Qwen2_5_VLForConditionalGeneration): the vision tower ("visual"), a Qwen2 decoder ("model")
// whose RoPE is multimodal (each token has a temporal, row and column position), and
// lm_head. Image and video features replace their placeholder tokens' embeddings.
#pragma once

#include "models/causal_lm.h"
#include "models/decoder.h"
#include "models/vision.h"

namespace fsdpp {

// The images and videos of a batch, cut into patches as the HF processor cuts them.
struct VisionInputs {
  torch::Tensor pixel_values;         // [Ni, C * Tt * P * P] image patches; undefined: none
  torch::Tensor image_grid_thw;       // [I, 3] int64: frames, rows, columns of patches per image
  torch::Tensor pixel_values_videos;  // [Nv, C * Tt * P * P] video patches; undefined: none
  torch::Tensor video_grid_thw;       // [V, 3] int64
  torch::Tensor second_per_grid_ts;   // [V] seconds per temporal patch (Qwen2.5-VL); undefined: 1

  // The patches on `device`; grids and timings stay on the host, where positions are planned.
  VisionInputs to(const torch::Device& device) const {
    VisionInputs moved = *this;
    if (pixel_values.defined()) moved.pixel_values = pixel_values.to(device);
    if (pixel_values_videos.defined()) moved.pixel_values_videos = pixel_values_videos.to(device);
    return moved;
  }
};

class VisionLanguageLM : public CausalLM {
 public:
  VisionLanguageLM(const ModelConfig& config, const torch::TensorOptions& opts);
  FSDPP_MODULE_CALL
  torch::Tensor forward(const torch::Tensor& input_ids) override;  // text only: [B, T] -> [B, T, V]
  // input_ids [B, T] holding one placeholder token per merged patch group of each image and
  // video, in order -> logits [B, T, V].
  torch::Tensor forward(const torch::Tensor& input_ids, const VisionInputs& vision);

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
