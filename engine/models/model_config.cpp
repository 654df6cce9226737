// Parsing and validation of Hugging Face config.json files.
#include "models/model_config.h"

#include "core/error.h"
#include "core/mapped_file.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace fsdpp {

namespace {

using nlohmann::json;

template <class T>
T read(const json& j, const std::string& key, const std::string& origin, const T& fallback,
       bool required = false) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) throw UserError(origin + ": missing key '" + key + "'");
    return fallback;
  }
  // JSON numbers convert silently (2.5 layers would load as 2): integers must be integers,
  // and every number finite.
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    if (!it->is_number_integer()) throw UserError(origin + ": " + key + " must be an integer, got " + it->dump());
  }
  if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    if (!it->is_array() || !std::all_of(it->begin(), it->end(), [](const json& v) { return v.is_number_integer(); })) {
      throw UserError(origin + ": " + key + " must be a list of integers, got " + it->dump());
    }
  }
  if constexpr (std::is_floating_point_v<T>) {
    if (!it->is_number() || !std::isfinite(it->get<double>())) {
      throw UserError(origin + ": " + key + " must be a finite number, got " + it->dump());
    }
  }
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    throw UserError(origin + ": key '" + key + "' has the wrong type (" + it->type_name() + ")");
  }
}

// Sizes beyond any model this engine can hold, and far from where size arithmetic overflows.
constexpr int64_t kMaxVocab = int64_t{1} << 24;
constexpr int64_t kMaxWidth = int64_t{1} << 20;  // hidden, intermediate, head_dim
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxHeads = 4096;
constexpr int64_t kMaxPositions = int64_t{1} << 24;
constexpr int64_t kMaxExperts = 4096;
constexpr double kMaxParameters = 1e12;

void check_range(const std::string& origin, const char* key, int64_t value, int64_t min, int64_t max) {
  if (value < min || value > max) {
    throw UserError(origin + ": " + key + " must be in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " +
                    std::to_string(value));
  }
}

void check_positive(const std::string& origin, const char* key, double value) {
  if (!(value > 0)) throw UserError(origin + ": " + key + " must be positive, got " + std::to_string(value));
}

// YaRN's keys; the pre-extension context defaults to max_position_embeddings (0 here until
// the caller knows it).
void read_yarn(const json& block, const std::string& where, RopeScaling& r) {
  if (!block.contains("factor")) throw UserError(where + ": missing key 'factor'");
  r.original_max_position_embeddings = read<int64_t>(block, "original_max_position_embeddings", where, 0);
  if (r.original_max_position_embeddings != 0) {
    check_range(where, "original_max_position_embeddings", r.original_max_position_embeddings, 1, kMaxPositions);
  }
  r.beta_fast = read<double>(block, "beta_fast", where, 32.0);
  r.beta_slow = read<double>(block, "beta_slow", where, 1.0);
  r.mscale = read<double>(block, "mscale", where, 0.0);
  r.mscale_all_dim = read<double>(block, "mscale_all_dim", where, 0.0);
  if (block.contains("attention_factor") && !block["attention_factor"].is_null()) {
    r.attention_factor = read<double>(block, "attention_factor", where, 1.0);
    check_positive(where, "attention_factor", *r.attention_factor);
  }
  r.truncate = read<bool>(block, "truncate", where, true);
  check_positive(where, "beta_fast", r.beta_fast);
  check_positive(where, "beta_slow", r.beta_slow);
}

RopeScaling read_rope_scaling(const json& j, const std::string& origin) {
  RopeScaling r;
  // Newer files call the block rope_parameters and may keep "default" there too.
  const json* block = nullptr;
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (j.contains(key) && j[key].is_object()) block = &j[key];
  }
  if (block == nullptr) return r;
  std::string where = origin + ": rope_scaling";
  r.rope_type = read<std::string>(*block, "rope_type", where,
                                  read<std::string>(*block, "type", where, "default"));
  r.factor = read<double>(*block, "factor", where, 1.0);
  check_positive(where, "factor", r.factor);
  r.mrope_section = read<std::vector<int64_t>>(*block, "mrope_section", where, {});
  for (int64_t s : r.mrope_section) check_range(where, "mrope_section", s, 1, kMaxWidth);
  if (r.rope_type == "mrope") r.rope_type = "default";  // the frequencies are the default ones
  if (r.rope_type == "llama3") {
    r.low_freq_factor = read<double>(*block, "low_freq_factor", where, 1.0, true);
    r.high_freq_factor = read<double>(*block, "high_freq_factor", where, 4.0, true);
    r.original_max_position_embeddings =
        read<int64_t>(*block, "original_max_position_embeddings", where, 8192, true);
    check_positive(where, "low_freq_factor", r.low_freq_factor);
    check_range(where, "original_max_position_embeddings", r.original_max_position_embeddings, 1, kMaxPositions);
    if (r.high_freq_factor <= r.low_freq_factor) {
      throw UserError(where + ": high_freq_factor " + std::to_string(r.high_freq_factor) +
                      " must exceed low_freq_factor " + std::to_string(r.low_freq_factor));
    }
  } else if (r.rope_type == "yarn") {
    read_yarn(*block, where, r);
  } else if (r.rope_type != "default" && r.rope_type != "linear") {
    throw UserError(where + ": rope_type '" + r.rope_type +
                    "' is not supported (default, linear, llama3, yarn)");
  }
  return r;
}

VisionConfig read_vision(const json& j, const std::string& model_type, const std::string& origin) {
  const std::string where = origin + ": vision_config";
  VisionConfig v;
  v.depth = read<int64_t>(j, "depth", where, 0, true);
  v.num_heads = read<int64_t>(j, "num_heads", where, 0, true);
  v.patch_size = read<int64_t>(j, "patch_size", where, 14);
  v.temporal_patch_size = read<int64_t>(j, "temporal_patch_size", where, 2);
  v.spatial_merge_size = read<int64_t>(j, "spatial_merge_size", where, 2);
  v.in_channels = read<int64_t>(j, "in_channels", where, read<int64_t>(j, "in_chans", where, 3));
  if (model_type == "qwen2_vl") {
    v.embed_dim = read<int64_t>(j, "embed_dim", where, 0, true);
    v.out_hidden_size = read<int64_t>(j, "hidden_size", where, 0, true);
    // Checked as a double: a ratio past int64 would make the cast undefined.
    const double inner = static_cast<double>(v.embed_dim) * read<double>(j, "mlp_ratio", where, 4.0);
    if (!(inner >= 1 && inner <= static_cast<double>(kMaxWidth))) {
      throw UserError(where + ": embed_dim x mlp_ratio = " + std::to_string(inner) + " is not in [1, " +
                      std::to_string(kMaxWidth) + "]");
    }
    v.intermediate_size = static_cast<int64_t>(inner);
    v.hidden_act = read<std::string>(j, "hidden_act", where, "quick_gelu");
  } else {
    v.windowed = true;
    v.embed_dim = read<int64_t>(j, "hidden_size", where, 0, true);
    v.out_hidden_size = read<int64_t>(j, "out_hidden_size", where, 0, true);
    v.intermediate_size = read<int64_t>(j, "intermediate_size", where, 0, true);
    v.hidden_act = read<std::string>(j, "hidden_act", where, "silu");
    v.window_size = read<int64_t>(j, "window_size", where, 112);
    v.fullatt_block_indexes = read<std::vector<int64_t>>(j, "fullatt_block_indexes", where, {7, 15, 23, 31});
    v.tokens_per_second = read<double>(j, "tokens_per_second", where, 4.0);
  }
  check_range(where, "depth", v.depth, 1, kMaxLayers);
  check_range(where, "num_heads", v.num_heads, 1, kMaxHeads);
  for (auto [key, value] : {std::pair{"patch_size", v.patch_size}, {"temporal_patch_size", v.temporal_patch_size},
                            {"spatial_merge_size", v.spatial_merge_size}, {"in_channels", v.in_channels},
                            {"out_hidden_size", v.out_hidden_size}, {"intermediate_size", v.intermediate_size}}) {
    check_range(where, key, value, 1, kMaxWidth);
  }
  check_range(where, "width", v.embed_dim, 1, kMaxWidth);
  if (v.windowed) {
    check_range(where, "window_size", v.window_size, 1, kMaxPositions);
    check_positive(where, "tokens_per_second", v.tokens_per_second);
    if (v.window_size % (v.patch_size * v.spatial_merge_size) != 0) {
      throw UserError(where + ": window_size " + std::to_string(v.window_size) + " is not a multiple of patch_size " +
                      std::to_string(v.patch_size) + " × spatial_merge_size " + std::to_string(v.spatial_merge_size));
    }
  }
  if (v.embed_dim <= 0 || v.num_heads <= 0 || v.embed_dim % v.num_heads != 0) {
    throw UserError(where + ": width " + std::to_string(v.embed_dim) + " must be a positive multiple of num_heads " +
                    std::to_string(v.num_heads));
  }
  const std::string expected = model_type == "qwen2_vl" ? "quick_gelu" : "silu";
  if (v.hidden_act != expected) {
    throw UserError(where + ": hidden_act '" + v.hidden_act + "' is not supported (" + expected + ")");
  }
  return v;
}

// Qwen3-MoE's experts; defaults as transformers' Qwen3MoeConfig.
MoeConfig read_qwen3_moe(const json& j, int64_t layers, const std::string& origin) {
  MoeConfig m;
  m.num_experts = read<int64_t>(j, "num_experts", origin, 0, true);
  m.num_experts_per_tok = read<int64_t>(j, "num_experts_per_tok", origin, 0, true);
  m.moe_intermediate_size = read<int64_t>(j, "moe_intermediate_size", origin, 0, true);
  m.norm_topk_prob = read<bool>(j, "norm_topk_prob", origin, false);
  m.decoder_sparse_step = read<int64_t>(j, "decoder_sparse_step", origin, 1);
  m.mlp_only_layers = read<std::vector<int64_t>>(j, "mlp_only_layers", origin, {});
  m.router_aux_loss_coef = read<double>(j, "router_aux_loss_coef", origin, 0.001);
  check_range(origin, "num_experts", m.num_experts, 1, kMaxExperts);
  check_range(origin, "num_experts_per_tok", m.num_experts_per_tok, 1, m.num_experts);
  check_range(origin, "moe_intermediate_size", m.moe_intermediate_size, 1, kMaxWidth);
  check_range(origin, "decoder_sparse_step", m.decoder_sparse_step, 1, layers);
  for (int64_t layer : m.mlp_only_layers) check_range(origin, "mlp_only_layers", layer, 0, layers - 1);
  if (m.router_aux_loss_coef < 0) throw UserError(origin + ": router_aux_loss_coef must not be negative");
  return m;
}

// DeepSeek-V3's experts; defaults as transformers' DeepseekV3Config.
MoeConfig read_deepseek_moe(const json& j, int64_t layers, const std::string& origin) {
  MoeConfig m{.routing = MoeConfig::Routing::grouped_sigmoid};
  m.num_experts = read<int64_t>(j, "n_routed_experts", origin, 256);
  m.num_experts_per_tok = read<int64_t>(j, "num_experts_per_tok", origin, 8);
  m.moe_intermediate_size = read<int64_t>(j, "moe_intermediate_size", origin, 2048);
  m.norm_topk_prob = read<bool>(j, "norm_topk_prob", origin, true);
  m.first_k_dense_replace = read<int64_t>(j, "first_k_dense_replace", origin, 3);
  m.n_shared_experts = read<int64_t>(j, "n_shared_experts", origin, 1);
  m.routed_scaling_factor = read<double>(j, "routed_scaling_factor", origin, 2.5);
  m.n_group = read<int64_t>(j, "n_group", origin, 8);
  m.topk_group = read<int64_t>(j, "topk_group", origin, 4);
  check_range(origin, "n_routed_experts", m.num_experts, 1, kMaxExperts);
  check_range(origin, "moe_intermediate_size", m.moe_intermediate_size, 1, kMaxWidth);
  check_range(origin, "first_k_dense_replace", m.first_k_dense_replace, 0, layers);
  check_range(origin, "n_shared_experts", m.n_shared_experts, 0, kMaxExperts);
  check_positive(origin, "routed_scaling_factor", m.routed_scaling_factor);
  check_range(origin, "n_group", m.n_group, 1, m.num_experts);
  if (m.num_experts % m.n_group != 0 || m.num_experts / m.n_group < 2) {
    throw UserError(origin + ": n_routed_experts " + std::to_string(m.num_experts) + " must split into n_group " +
                    std::to_string(m.n_group) + " groups of at least 2 experts (a group scores by its best two)");
  }
  check_range(origin, "topk_group", m.topk_group, 1, m.n_group);
  check_range(origin, "num_experts_per_tok", m.num_experts_per_tok, 1, m.topk_group * (m.num_experts / m.n_group));
  return m;
}

// DeepSeek-V3's attention widths; defaults as transformers' DeepseekV3Config.
LatentAttentionConfig read_latent_attention(const json& j, const std::string& origin) {
  LatentAttentionConfig a;
  a.q_lora_rank = read<int64_t>(j, "q_lora_rank", origin, 0);  // null: no query compression
  a.kv_lora_rank = read<int64_t>(j, "kv_lora_rank", origin, 512);
  a.qk_nope_head_dim = read<int64_t>(j, "qk_nope_head_dim", origin, 128);
  a.qk_rope_head_dim = read<int64_t>(j, "qk_rope_head_dim", origin, 64);
  a.v_head_dim = read<int64_t>(j, "v_head_dim", origin, 128);
  a.rope_interleave = read<bool>(j, "rope_interleave", origin, true);
  if (a.q_lora_rank != 0) check_range(origin, "q_lora_rank", a.q_lora_rank, 1, kMaxWidth);
  for (auto [key, value] : {std::pair{"kv_lora_rank", a.kv_lora_rank}, {"qk_nope_head_dim", a.qk_nope_head_dim},
                            {"qk_rope_head_dim", a.qk_rope_head_dim}, {"v_head_dim", a.v_head_dim}}) {
    check_range(origin, key, value, 1, kMaxWidth);
  }
  return a;
}

}  // namespace

bool MoeConfig::is_moe_layer(int64_t layer) const {
  if (routing == Routing::grouped_sigmoid) return layer >= first_k_dense_replace;
  return (layer + 1) % decoder_sparse_step == 0 &&
         std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) == mlp_only_layers.end();
}

ModelConfig ModelConfig::from_file(const std::filesystem::path& path) {
  return from_text(read_text_file(path), path.string());
}

ModelConfig ModelConfig::from_text(const std::string& text, const std::string& origin) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {  // a syntax error, or a number past double (406)
    throw UserError(origin + ": not valid JSON (" + e.what() + ")");
  }
  return from_json(j, origin);
}

ModelConfig ModelConfig::from_json(const json& file, const std::string& origin) {
  if (!file.is_object()) throw UserError(origin + ": a model config must be a JSON object");
  ModelConfig c;
  c.model_type = read<std::string>(file, "model_type", origin, "", true);
  // Multimodal files keep the language model's keys in text_config (older ones at the top).
  json j = file;
  if (file.contains("text_config") && file["text_config"].is_object()) {
    for (const auto& [key, value] : file["text_config"].items()) {
      if (key != "model_type") j[key] = value;
    }
  }
  c.vocab_size = read<int64_t>(j, "vocab_size", origin, 0, true);
  c.hidden_size = read<int64_t>(j, "hidden_size", origin, 0, true);
  c.intermediate_size = read<int64_t>(j, "intermediate_size", origin, 0, true);
  c.num_hidden_layers = read<int64_t>(j, "num_hidden_layers", origin, 0, true);
  c.num_attention_heads = read<int64_t>(j, "num_attention_heads", origin, 0, true);
  c.num_key_value_heads = read<int64_t>(j, "num_key_value_heads", origin, c.num_attention_heads);
  if (c.num_attention_heads <= 0 || c.hidden_size <= 0) {
    throw UserError(origin + ": hidden_size and num_attention_heads must be positive");
  }
  c.head_dim = read<int64_t>(j, "head_dim", origin, c.hidden_size / c.num_attention_heads);
  c.max_position_embeddings = read<int64_t>(j, "max_position_embeddings", origin, 2048);
  c.rms_norm_eps = read<double>(j, "rms_norm_eps", origin, 1e-6);
  c.rope_theta = read<double>(j, "rope_theta", origin, 10000.0);
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {
    c.rope_theta = read<double>(j["rope_parameters"], "rope_theta", origin, c.rope_theta);
  }
  c.rope_scaling = read_rope_scaling(j, origin);
  c.tie_word_embeddings = read<bool>(j, "tie_word_embeddings", origin, false);
  c.attention_bias = read<bool>(j, "attention_bias", origin, false);
  c.mlp_bias = read<bool>(j, "mlp_bias", origin, false);
  c.initializer_range = read<double>(j, "initializer_range", origin, 0.02);
  c.hidden_act = read<std::string>(j, "hidden_act", origin, "silu");
  // Mistral's window applies whenever it is set; Qwen2's configs carry one that applies only
  // with use_sliding_window, which is refused below.
  if (c.model_type == "mistral") {
    c.sliding_window = read<int64_t>(j, "sliding_window", origin, 0);
    if (c.sliding_window != 0) check_range(origin, "sliding_window", c.sliding_window, 1, kMaxPositions);
  }
  if (read<bool>(j, "use_sliding_window", origin, false)) {
    throw UserError(origin + ": use_sliding_window = true is not supported");
  }
  if (c.model_type == "qwen3_moe") c.moe = read_qwen3_moe(j, c.num_hidden_layers, origin);
  if (c.model_type == "deepseek_v3") {
    c.moe = read_deepseek_moe(j, c.num_hidden_layers, origin);
    c.latent_attention = read_latent_attention(j, origin);
    c.head_dim = c.latent_attention->qk_rope_head_dim;  // what RoPE rotates, as transformers sets it
  }
  if (c.rope_scaling.original_max_position_embeddings == 0) {
    c.rope_scaling.original_max_position_embeddings = c.max_position_embeddings;
  }
  if (c.hidden_act != "silu") {
    throw UserError(origin + ": hidden_act '" + c.hidden_act + "' is not supported (silu)");
  }
  check_range(origin, "vocab_size", c.vocab_size, 1, kMaxVocab);
  for (auto [key, value] : {std::pair{"hidden_size", c.hidden_size}, {"intermediate_size", c.intermediate_size},
                            {"head_dim", c.head_dim}}) {
    check_range(origin, key, value, 1, kMaxWidth);
  }
  check_range(origin, "num_hidden_layers", c.num_hidden_layers, 1, kMaxLayers);
  check_range(origin, "num_attention_heads", c.num_attention_heads, 1, kMaxHeads);
  check_range(origin, "num_key_value_heads", c.num_key_value_heads, 1, c.num_attention_heads);
  check_range(origin, "max_position_embeddings", c.max_position_embeddings, 1, kMaxPositions);
  check_positive(origin, "rms_norm_eps", c.rms_norm_eps);
  check_positive(origin, "rope_theta", c.rope_theta);
  if (c.initializer_range < 0) throw UserError(origin + ": initializer_range must not be negative");
  // Each layer's projections and MLP, and the embeddings: refused before anything is built.
  const double h = static_cast<double>(c.hidden_size), q = static_cast<double>(c.num_attention_heads * c.head_dim),
               kv = static_cast<double>(c.num_key_value_heads * c.head_dim);
  const double mlp = c.moe ? static_cast<double>(c.moe->num_experts * c.moe->moe_intermediate_size)
                           : static_cast<double>(c.intermediate_size);
  const double parameters = static_cast<double>(c.num_hidden_layers) * (h * (2 * q + 2 * kv) + 3 * h * mlp) +
                            2 * h * static_cast<double>(c.vocab_size);
  if (parameters > kMaxParameters) {
    throw UserError(origin + ": describes a model of about " + std::to_string(static_cast<int64_t>(parameters / 1e9)) +
                    "B parameters, more than the " + std::to_string(static_cast<int64_t>(kMaxParameters / 1e9)) +
                    "B this engine builds");
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    throw UserError(origin + ": num_attention_heads " + std::to_string(c.num_attention_heads) +
                    " is not a multiple of num_key_value_heads " +
                    std::to_string(c.num_key_value_heads));
  }
  if (c.head_dim % 2 != 0) {
    throw UserError(origin + ": head_dim " + std::to_string(c.head_dim) + " must be even for RoPE");
  }
  const bool vision_language = c.model_type == "qwen2_vl" || c.model_type == "qwen2_5_vl";
  if (vision_language && !file.contains("vision_config")) {
    throw UserError(origin + ": model_type '" + c.model_type + "' needs a vision_config");
  }
  if (file.contains("vision_config")) {
    if (!file["vision_config"].is_object()) throw UserError(origin + ": vision_config is not an object");
    c.vision = read_vision(file["vision_config"], c.model_type, origin);
    c.image_token_id = read<int64_t>(file, "image_token_id", origin, -1, true);
    c.video_token_id = read<int64_t>(file, "video_token_id", origin, -1, true);
    c.vision_start_token_id = read<int64_t>(file, "vision_start_token_id", origin, -1, true);
    for (auto [key, value] : {std::pair{"image_token_id", c.image_token_id}, {"video_token_id", c.video_token_id},
                              {"vision_start_token_id", c.vision_start_token_id}}) {
      check_range(origin, key, value, 0, c.vocab_size - 1);
    }
    int64_t pairs = 0;
    for (int64_t s : c.rope_scaling.mrope_section) pairs += s;
    if (c.rope_scaling.mrope_section.size() != 3 || pairs * 2 != c.head_dim) {
      throw UserError(origin + ": rope_scaling.mrope_section must be 3 sizes summing to head_dim / 2 = " +
                      std::to_string(c.head_dim / 2));
    }
  }
  c.raw = std::make_shared<const json>(file);
  return c;
}

}  // namespace fsdpp
