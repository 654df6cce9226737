// The architecture of a decoder-only language model, read from a Hugging Face config.json.
// Field names follow the file's keys; defaults are those of transformers' config classes.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdpp {

// How RoPE's frequencies are scaled past the trained context: transformers' rope_type.
enum class RopeType {
  plain,   // "default" (and multimodal RoPE's "mrope", whose frequencies are the default ones)
  linear,  // every frequency divided by the factor
  llama3,  // long wavelengths divided, short ones kept, a smooth band between
  yarn,    // YaRN's blend, with its attention factor
};

struct RopeScaling {
  RopeType rope_type = RopeType::plain;
  double factor = 1.0;                // context extension factor
  double low_freq_factor = 1.0;       // llama3: wavelengths above old_context/low are scaled
  double high_freq_factor = 4.0;      // llama3: wavelengths below old_context/high are kept
  int64_t original_max_position_embeddings = 8192;  // llama3, yarn: the pre-extension context
  double beta_fast = 32.0;            // yarn: rotations above which frequencies are kept ...
  double beta_slow = 1.0;             // ... and below which they are interpolated
  double mscale = 0.0;                // yarn: attention_factor = m(factor, mscale) / m(factor, mscale_all_dim)
  double mscale_all_dim = 0.0;        // any scaling: DeepSeek-V3's softmax times m(factor, mscale_all_dim)^2
  std::optional<double> attention_factor;  // yarn: cos and sin scale, when given outright
  bool truncate = true;               // yarn: the correction range rounded outwards to whole dimensions
  std::vector<int64_t> mrope_section;  // multimodal RoPE: frequency pairs for the t, h, w axes

  bool operator==(const RopeScaling&) const = default;
};

// The vision tower of a Qwen2-VL or Qwen2.5-VL model (config.json's vision_config).
struct VisionConfig {
  bool windowed = false;            // Qwen2.5-VL's tower: RMSNorm, SwiGLU, window attention
  int64_t depth = 0;                // vision blocks
  int64_t embed_dim = 0;            // block width
  int64_t out_hidden_size = 0;      // merger output: the language model's hidden_size
  int64_t num_heads = 0;            // attention heads per block
  int64_t intermediate_size = 0;    // MLP inner width
  int64_t patch_size = 14;          // pixels per patch side
  int64_t temporal_patch_size = 2;  // frames per patch
  int64_t spatial_merge_size = 2;   // patches merged per side into one language token
  int64_t in_channels = 3;
  std::string hidden_act;           // quick_gelu (Qwen2-VL) or silu (Qwen2.5-VL)
  int64_t window_size = 0;          // Qwen2.5-VL: window attention span in pixels
  std::vector<int64_t> fullatt_block_indexes;  // Qwen2.5-VL: blocks attending over the whole image
  double tokens_per_second = 0.0;   // Qwen2.5-VL: temporal RoPE positions per second of video
  double rope_theta = 10000.0;      // base of the patches' 2-D RoPE

  bool operator==(const VisionConfig&) const = default;
};

// The routed experts of a mixture-of-experts model.
struct MoeConfig {
  // Qwen3-MoE: softmax over the experts, the top K. DeepSeek-V3: sigmoid scores plus a
  // correction bias choose the top K inside the best topk_group of n_group expert groups.
  enum class Routing { softmax_top_k, grouped_sigmoid };
  Routing routing = Routing::softmax_top_k;
  int64_t num_experts = 0;             // routed experts per MoE layer E (n_routed_experts)
  int64_t num_experts_per_tok = 0;     // experts each token is routed to K
  int64_t moe_intermediate_size = 0;   // each expert's SwiGLU inner width
  bool norm_topk_prob = false;         // rescale a token's K routing weights to sum to 1
  // qwen3_moe
  int64_t decoder_sparse_step = 1;     // layer i is MoE when (i + 1) % step == 0 ...
  std::vector<int64_t> mlp_only_layers;  // ... and i is not listed here (those stay dense)
  double router_aux_loss_coef = 0.0;   // weight of the load-balancing loss added in training
  // deepseek_v3
  int64_t first_k_dense_replace = 0;   // layers before this one stay dense
  int64_t n_shared_experts = 0;        // experts every token passes through, as one wider MLP
  double routed_scaling_factor = 1.0;  // scales the routed experts' weights
  int64_t n_group = 1;                 // expert groups ...
  int64_t topk_group = 1;              // ... of which a token's K experts come from the best these many

  bool is_moe_layer(int64_t layer) const;
  bool operator==(const MoeConfig&) const = default;
};

// DeepSeek-V3's multi-head latent attention: queries (optionally) and keys/values pass through
// low-rank projections; each head's query and key are a part without position and a part
// rotated by RoPE, whose key part is shared by all heads.
struct LatentAttentionConfig {
  int64_t q_lora_rank = 0;       // 0: queries projected directly (q_proj)
  int64_t kv_lora_rank = 0;      // the compressed key/value width
  int64_t qk_nope_head_dim = 0;  // per head: query/key part without position
  int64_t qk_rope_head_dim = 0;  // per head: query/key part with RoPE (config.head_dim)
  int64_t v_head_dim = 0;        // per head: value width
  bool rope_interleave = true;   // the rotary part's pairs are interleaved in the weights

  bool operator==(const LatentAttentionConfig&) const = default;
};

// The model_type values a config.json may name: those models/registry.cpp builds.
const std::vector<std::string>& supported_model_types();

struct ModelConfig {
  std::string model_type;             // registry key: "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", ...
  int64_t vocab_size = 0;             // embedding rows and logits width
  int64_t hidden_size = 0;            // residual stream width C
  int64_t intermediate_size = 0;      // SwiGLU inner width
  int64_t num_hidden_layers = 0;      // decoder layers L
  int64_t num_attention_heads = 0;    // query heads H
  int64_t num_key_value_heads = 0;    // key/value heads (GQA); defaults to H
  int64_t head_dim = 0;               // per-head width D; defaults to C / H
  int64_t max_position_embeddings = 2048;  // longest sequence the RoPE tables cover
  double rms_norm_eps = 1e-6;         // RMSNorm epsilon
  double rope_theta = 10000.0;        // RoPE base
  int64_t sliding_window = 0;         // mistral: a token attends to the last W tokens only; 0: all
  RopeScaling rope_scaling;           // RoPE frequency scaling
  bool tie_word_embeddings = false;   // lm_head.weight is model.embed_tokens.weight
  // A sequence-classification model's (a reward model's, a critic's) score outputs: its head
  // is score [labels, C] in place of lm_head, scoring every token. 0: a language model.
  int64_t num_labels = 0;
  // pad_token_id as the embedding's row: transformers' embeddings (nn.Embedding's padding_idx)
  // give it no gradient, and initialise it to zero. A negative id counts from the end, as
  // there; -1 here: none.
  int64_t padding_row = -1;
  bool attention_bias = false;        // bias on q/k/v/o (always on q/k/v for qwen2)
  bool mlp_bias = false;              // bias on the MLP projections (llama)
  double initializer_range = 0.02;    // std of the normal initialiser
  std::string hidden_act = "silu";    // only SwiGLU with SiLU is supported
  std::optional<MoeConfig> moe;       // mixture-of-experts models: the routed experts
  std::optional<LatentAttentionConfig> latent_attention;  // deepseek_v3
  std::optional<VisionConfig> vision; // multimodal models: the vision tower
  int64_t image_token_id = -1;        // placeholders the vision features replace
  int64_t video_token_id = -1;
  int64_t vision_start_token_id = -1; // opens each image or video in the token sequence
  std::shared_ptr<const nlohmann::json> raw;  // the file as read, for export

  // The attention heads' widths: query/key and value (latent attention's nope + rope and
  // v_head_dim; head_dim for both elsewhere).
  int64_t query_key_head_dim() const {
    return latent_attention ? latent_attention->qk_nope_head_dim + latent_attention->qk_rope_head_dim : head_dim;
  }
  int64_t value_head_dim() const { return latent_attention ? latent_attention->v_head_dim : head_dim; }

  // The fields in which `other` computes otherwise than this config, by their config.json
  // names with both values ("num_attention_heads 3 -> 15"; a section by its name alone):
  // empty where both build the same model. What changes no output (the initialiser's
  // range, the context length where no scaling reads it) is not counted.
  std::vector<std::string> differences(const ModelConfig& other) const;

  // Reads and validates `path`; every problem names the file and key.
  static ModelConfig from_file(const std::filesystem::path& path);
  static ModelConfig from_text(const std::string& text, const std::string& origin);
  static ModelConfig from_json(const nlohmann::json& json, const std::string& origin);
};

}  // namespace fsdpp
