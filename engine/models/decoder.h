// The Llama family of decoder-only transformers: Llama, Mistral, Qwen2 and Qwen3 differ only
// in class names, q/k/v bias, Qwen3's per-head q/k RMSNorm and Mistral's sliding window (from
// its config), so one implementation with a DecoderFamily description builds all four.
#pragma once

#include "models/causal_lm.h"
#include "models/layers.h"

namespace fsdpp {

struct DecoderFamily {
  std::string prefix;      // class-name prefix: "Llama", "Mistral", "Qwen2", "Qwen3", "Qwen2VL"
  bool qkv_bias = false;   // q/k/v always carry a bias (qwen2), else config.attention_bias
  bool qk_norm = false;    // RMSNorm over each head of q and k before RoPE (qwen3)
};

class Attention : public Module {
 public:
  Attention(const DecoderFamily& family, const ModelConfig& config,
            const torch::TensorOptions& opts);
  FSDPP_MODULE_CALL
  // x [B, T, C], cos_sin [2, T, D] or [2, B, T, D], attention_mask from
  // restricted_causal_mask (models/document_attention.h; undefined: causal rows) -> [B, T, C]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos_sin, const torch::Tensor& attention_mask);

 private:
  int64_t heads_, kv_heads_, head_dim_;
  std::shared_ptr<Linear> q_proj_, k_proj_, v_proj_, o_proj_;
  std::shared_ptr<RMSNorm> q_norm_, k_norm_;
};

class MLP : public Module {
 public:
  MLP(const DecoderFamily& family, const ModelConfig& config, const torch::TensorOptions& opts);
  FSDPP_MODULE_CALL
  torch::Tensor forward(const torch::Tensor& x);  // [B, T, C] -> [B, T, C]

 private:
  std::shared_ptr<Linear> gate_proj_, up_proj_, down_proj_;
};

class DecoderLayer : public Module {
 public:
  DecoderLayer(const DecoderFamily& family, const ModelConfig& config,
               const torch::TensorOptions& opts);
  FSDPP_MODULE_CALL
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos_sin, const torch::Tensor& attention_mask);

 private:
  std::shared_ptr<RMSNorm> input_layernorm_, post_attention_layernorm_;
  std::shared_ptr<Attention> self_attn_;
  std::shared_ptr<MLP> mlp_;
};

// The transformer body ("LlamaModel"): embeddings, layers, final norm.
class DecoderModel : public Module {
 public:
  DecoderModel(const DecoderFamily& family, const ModelConfig& config,
               const torch::TensorOptions& opts, const std::string& class_name = "");
  FSDPP_MODULE_CALL
  // input_ids [B, T], documents as in models/document_attention.h (undefined: one sequence
  // per row) -> [B, T, C]
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& documents = {});
  // Embeddings the caller made (with vision features placed in them) and multimodal RoPE
  // positions: inputs_embeds [B, T, C], position_ids [3, B, T], documents as above -> [B, T, C].
  torch::Tensor forward(const torch::Tensor& inputs_embeds, const torch::Tensor& position_ids,
                        const torch::Tensor& documents);

  std::shared_ptr<Embedding> embed_tokens;

 private:
  std::vector<std::shared_ptr<DecoderLayer>> layers_;
  std::shared_ptr<RMSNorm> norm_;
  std::shared_ptr<RotaryEmbedding> rotary_emb_;
  int64_t sliding_window_;  // 0: none
};

class DecoderCausalLM : public CausalLM {
 public:
  DecoderCausalLM(const DecoderFamily& family, const ModelConfig& config,
                  const torch::TensorOptions& opts);
  torch::Tensor forward(const torch::Tensor& input_ids) override;
  torch::Tensor forward(const torch::Tensor& input_ids, const DocumentStarts& documents) override;

 private:
  std::shared_ptr<DecoderModel> model_;
  std::shared_ptr<Linear> lm_head_;
};

}  // namespace fsdpp
