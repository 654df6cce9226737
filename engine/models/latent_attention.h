// DeepSeek-V3's multi-head latent attention (transformers' DeepseekV3Attention). Queries come
// from the hidden state directly (q_proj) or through a low-rank bottleneck (q_a_proj, its
// RMSNorm, q_b_proj); keys and values come from one compressed vector per token
// (kv_a_proj_with_mqa, its RMSNorm, kv_b_proj). Each head's query and key join a part
// without position to a part rotated by RoPE; the key's rotated part is one for all heads.
#pragma once

#include "models/decoder.h"

namespace fsdpp {

class LatentAttention : public SelfAttention {
 public:
  LatentAttention(const DecoderFamily& family, const ModelConfig& config, const torch::TensorOptions& opts);
  // cos_sin as the RoPE tables give them for qk_rope_head_dim.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos_sin,
                        const torch::Tensor& scope) override;

 private:
  torch::Tensor queries(const torch::Tensor& x);  // [B, T, C] -> [B, H, T, nope + rope]

  LatentAttentionConfig dims_;
  int64_t heads_;
  double scale_;  // the softmax scale: (nope + rope)^-1/2, times YaRN's mscale_all_dim factor
  std::shared_ptr<Linear> q_proj_;                                  // without q_lora_rank
  std::shared_ptr<Linear> q_a_proj_, q_b_proj_;                     // with it
  std::shared_ptr<RMSNorm> q_a_layernorm_;
  std::shared_ptr<Linear> kv_a_proj_with_mqa_, kv_b_proj_, o_proj_;
  std::shared_ptr<RMSNorm> kv_a_layernorm_;
};

}  // namespace fsdpp
