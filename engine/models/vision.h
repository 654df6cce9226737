// The vision towers of Qwen2-VL and Qwen2.5-VL: a 3-D patch embedding, ViT blocks whose
// attention stays inside each image or video frame and rotates q/k by the patch's 2-D (row,
// column) position, and the merger that turns each 2×2 group of patches into one language
// token. Qwen2.5-VL's blocks use RMSNorm and SwiGLU and attend within windows of merge
// groups, except the full-attention blocks. Parameter names are Hugging Face's
// (visual.patch_embed.proj, visual.blocks.N..., visual.merger...).
#pragma once

#include "models/decoder.h"
#include "models/layers.h"
#include "models/model_config.h"

namespace fsdpp {

// Conv3d with stride = kernel over patches already cut to the kernel's size, as the HF
// processor cuts them: [N, C * Tt * P * P] -> [N, embed].
class PatchConv : public Module {
 public:
  PatchConv(const VisionConfig& config, const torch::TensorOptions& opts);
  FSDPP_MODULE_CALL
  torch::Tensor forward(const torch::Tensor& patches);
  void init_parameter(const std::string& name, torch::Tensor& t, at::Generator& gen, double std) override;

  torch::Tensor weight;  // [embed, C, Tt, P, P]
};

// HF's PatchEmbed: the convolution under the name "proj".
class PatchEmbed : public Module {
 public:
  PatchEmbed(const VisionConfig& config, const torch::TensorOptions& opts);
  FSDPP_MODULE_CALL
  torch::Tensor forward(const torch::Tensor& patches);  // [N, C * Tt * P * P] -> [N, E]

 private:
  std::shared_ptr<PatchConv> proj_;
};

class VisionAttention : public Module {
 public:
  VisionAttention(const VisionConfig& config, const torch::TensorOptions& opts);  // class name per variant
  FSDPP_MODULE_CALL
  // x [N, E], cos_sin [2, N, D], cu_seqlens [S + 1] (sequence boundaries) -> [N, E]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos_sin, const torch::Tensor& cu_seqlens);

 private:
  int64_t heads_, head_dim_;
  std::shared_ptr<Linear> qkv_, proj_;
};

class VisionMlp : public Module {
 public:
  VisionMlp(const VisionConfig& config, const torch::TensorOptions& opts);
  FSDPP_MODULE_CALL
  torch::Tensor forward(const torch::Tensor& x);  // [N, E] -> [N, E], quick GELU

 private:
  std::shared_ptr<Linear> fc1_, fc2_;
};

class VisionBlock : public Module {
 public:
  VisionBlock(const VisionConfig& config, const torch::TensorOptions& opts);
  FSDPP_MODULE_CALL
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos_sin, const torch::Tensor& cu_seqlens);

 private:
  torch::Tensor norm(int which, const torch::Tensor& x);

  std::shared_ptr<LayerNorm> layer_norm_[2];  // Qwen2-VL
  std::shared_ptr<RMSNorm> rms_norm_[2];      // Qwen2.5-VL
  std::shared_ptr<VisionAttention> attn_;
  std::shared_ptr<VisionMlp> mlp_;            // Qwen2-VL: fc1, quick GELU, fc2
  std::shared_ptr<MLP> swiglu_;               // Qwen2.5-VL: gate, up, down with biases
};

// LayerNorm, then each merge group's patches side by side through Linear, GELU, Linear.
class PatchMerger : public Module {
 public:
  PatchMerger(const VisionConfig& config, const torch::TensorOptions& opts);
  FSDPP_MODULE_CALL
  torch::Tensor forward(const torch::Tensor& x);  // [N, E] -> [N / m², out]

 private:
  int64_t group_width_;
  std::shared_ptr<LayerNorm> ln_q_;       // Qwen2-VL
  std::shared_ptr<RMSNorm> rms_q_;        // Qwen2.5-VL
  std::shared_ptr<Linear> fc1_, fc2_;  // "mlp.0" and "mlp.2", a GELU between them
};

class VisionTransformer : public Module {
 public:
  VisionTransformer(const VisionConfig& config, const torch::TensorOptions& opts);
  FSDPP_MODULE_CALL
  // patches [N, C * Tt * P * P] of the images or videos whose grids are grid_thw [I, 3]
  // (frames, rows, columns of patches) -> one feature per merged group [N / m², out].
  torch::Tensor forward(const torch::Tensor& patches, const torch::Tensor& grid_thw);

  const VisionConfig& config() const { return config_; }

 private:
  // [2, N, D] cos and sin of each patch's (row, column) rotation, in merge-group order.
  torch::Tensor rotary_tables(const torch::Tensor& grid_thw) const;
  // Qwen2.5-VL: the order of merge groups that puts each window's groups together [G],
  // and the windows' boundaries in patches [W + 1].
  std::pair<torch::Tensor, torch::Tensor> windows(const torch::Tensor& grid_thw) const;

  VisionConfig config_;
  torch::Tensor inv_freq_;  // [D / 4]
  std::shared_ptr<PatchEmbed> patch_embed_;
  std::vector<std::shared_ptr<VisionBlock>> blocks_;
  std::shared_ptr<PatchMerger> merger_;
};

}  // namespace fsdpp
