// The Llama family of decoder-only transformers: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and
// DeepSeek-V3 differ in class names, q/k/v bias, Qwen3's per-head q/k RMSNorm, Mistral's
// sliding window, the MoE models' sparse MLPs and DeepSeek-V3's latent attention (the last
// three from their configs), so one implementation with a DecoderFamily description builds
// all six. A layer's attention and feed-forward are each one of several kinds behind one call.
#pragma once

#include "models/causal_lm.h"
#include "models/kv_cache.h"
#include "models/layers.h"

namespace fsdpp {

struct DecoderFamily {
  std::string prefix;      // class-name prefix: "Llama", "Mistral", "Qwen2", "Qwen3", "Qwen3Moe", "DeepseekV3", "Qwen2VL"
  bool qkv_bias = false;   // q/k/v always carry a bias (qwen2), else config.attention_bias
  bool qk_norm = false;    // RMSNorm over each head of q and k before RoPE (qwen3)
};

// A decoder layer's attention: x [B, T, C], cos_sin [2, T, D] or [2, B, T, D], scope from
// attention_scope (models/document_attention.h; undefined: causal rows) -> [B, T, C].
class SelfAttention : public Module {
 public:
  using Module::Module;
  FSDPP_MODULE_CALL
  virtual torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos_sin,
                                const torch::Tensor& scope) = 0;
  // While a generation runs (null otherwise), forward keeps its keys and values in `cache` and
  // attends over all it holds; scope is then the step's mask (KvCache::begin_step).
  void decode_into(LayerCache* cache, int64_t capacity) { cache_ = cache, capacity_ = capacity; }

 protected:
  // key and value [B, heads, T, D] with what the generation cached before them in front (as
  // they are outside a generation).
  std::pair<torch::Tensor, torch::Tensor> with_cached(const torch::Tensor& key, const torch::Tensor& value) {
    return cache_ ? cache_->append(key, value, capacity_) : std::pair{key, value};
  }

 private:
  LayerCache* cache_ = nullptr;
  int64_t capacity_ = 0;
};

// A decoder layer's feed-forward part: [B, T, C] -> [B, T, C].
class FeedForward : public Module {
 public:
  using Module::Module;
  FSDPP_MODULE_CALL
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;
};

// Grouped-query attention, as Llama, Mistral and the Qwen models have it.
class Attention : public SelfAttention {
 public:
  Attention(const DecoderFamily& family, const ModelConfig& config,
            const torch::TensorOptions& opts);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos_sin,
                        const torch::Tensor& scope) override;

 private:
  int64_t heads_, kv_heads_, head_dim_;
  std::shared_ptr<Linear> q_proj_, k_proj_, v_proj_, o_proj_;
  std::shared_ptr<RMSNorm> q_norm_, k_norm_;
};

// SwiGLU: down(silu(gate(x)) * up(x)).
class MLP : public FeedForward {
 public:
  MLP(const DecoderFamily& family, const ModelConfig& config, int64_t intermediate_size,
      const torch::TensorOptions& opts);
  torch::Tensor forward(const torch::Tensor& x) override;

  // For Experts, which computes many MLPs in one grouped product of their weights.
  const Linear& gate_proj() const { return *gate_proj_; }
  const Linear& up_proj() const { return *up_proj_; }
  const Linear& down_proj() const { return *down_proj_; }

 private:
  std::shared_ptr<Linear> gate_proj_, up_proj_, down_proj_;
};

class DecoderLayer : public Module {
 public:
  // A MoE layer (config.moe says which) records its routing in `log`.
  DecoderLayer(const DecoderFamily& family, const ModelConfig& config, int64_t index,
               const torch::TensorOptions& opts, const std::shared_ptr<RoutingLog>& log);
  FSDPP_MODULE_CALL
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos_sin, const torch::Tensor& scope);
  SelfAttention& self_attn() { return *self_attn_; }

 private:
  std::shared_ptr<RMSNorm> input_layernorm_, post_attention_layernorm_;
  std::shared_ptr<SelfAttention> self_attn_;
  std::shared_ptr<FeedForward> mlp_;  // an MLP, or a MoE layer's experts
};

// RoPE positions a caller chose for the tokens of a forward.
struct AtPositions {
  torch::Tensor position_ids;  // [B, T] int64
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
  // input_ids [B, T] at the caller's positions, documents as above -> [B, T, C].
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& documents, const AtPositions& at);
  // One step of a generation: input_ids [B, T] after what `cache` holds, `kept` [B, T] bool
  // (false: padding) -> [B, T, C].
  torch::Tensor forward(const torch::Tensor& input_ids, KvCache& cache, const torch::Tensor& kept);
  // One step of a generation from embeddings the caller made: inputs_embeds [B, T, C] at
  // position_ids ([B, T], or [3, B, T] multimodal) laid out as `step` says (KvCache::begin_step's)
  // -> [B, T, C].
  torch::Tensor forward(const torch::Tensor& inputs_embeds, const torch::Tensor& position_ids, const CachedStep& step,
                        KvCache& cache);
  int64_t layer_count() const { return static_cast<int64_t>(layers_.size()); }
  int64_t sliding_window() const { return sliding_window_; }

  std::shared_ptr<Embedding> embed_tokens;
  // The MoE layers' routing in the last forward; null for dense models.
  RoutingLog* routing() const { return routing_.get(); }

 private:
  std::vector<std::shared_ptr<DecoderLayer>> layers_;
  std::shared_ptr<RMSNorm> norm_;
  std::shared_ptr<RotaryEmbedding> rotary_emb_;
  int64_t sliding_window_;  // 0: none
  int64_t attention_head_dim_;  // the query/key head size, which decides the attention kernel
  std::shared_ptr<RoutingLog> routing_;
};

class DecoderCausalLM : public CausalLM {
 public:
  DecoderCausalLM(const DecoderFamily& family, const ModelConfig& config,
                  const torch::TensorOptions& opts);
  torch::Tensor forward(const torch::Tensor& input_ids) override;
  torch::Tensor forward(const torch::Tensor& input_ids, const RowLayout& layout) override;
  torch::Tensor forward(const torch::Tensor& input_ids, const FinalHidden& ask) override;
  torch::Tensor forward(const torch::Tensor& input_ids, const GenerationStep& step) override;
  KvCache generation_cache(int64_t capacity) const override;
  torch::Tensor output_head_weight() const override { return head_->weight; }
  bool output_head_adapted() const override { return head_->has_adapter(); }
  RoutingLog* routing() const override { return model_->routing(); }

 private:
  // The final hidden states [B, T, C] of input_ids laid out as `layout` says.
  torch::Tensor hidden(const torch::Tensor& input_ids, const RowLayout& layout);

  std::shared_ptr<DecoderModel> model_;
  std::shared_ptr<Linear> head_;  // lm_head [V, C], or a sequence-classification model's score [labels, C]
};

}  // namespace fsdpp
