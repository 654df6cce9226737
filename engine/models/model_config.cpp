// Parsing and validation of Hugging Face config.json files.
#include "models/model_config.h"

#include "core/error.h"

#include <nlohmann/json.hpp>

#include <fstream>

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
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    throw UserError(origin + ": key '" + key + "' has the wrong type (" + it->type_name() + ")");
  }
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
  r.mrope_section = read<std::vector<int64_t>>(*block, "mrope_section", where, {});
  if (r.rope_type == "mrope") r.rope_type = "default";  // the frequencies are the default ones
  if (r.rope_type == "llama3") {
    r.low_freq_factor = read<double>(*block, "low_freq_factor", where, 1.0, true);
    r.high_freq_factor = read<double>(*block, "high_freq_factor", where, 4.0, true);
    r.original_max_position_embeddings =
        read<int64_t>(*block, "original_max_position_embeddings", where, 8192, true);
    if (r.high_freq_factor <= r.low_freq_factor) {
      throw UserError(where + ": high_freq_factor " + std::to_string(r.high_freq_factor) +
                      " must exceed low_freq_factor " + std::to_string(r.low_freq_factor));
    }
  } else if (r.rope_type != "default" && r.rope_type != "linear") {
    throw UserError(where + ": rope_type '" + r.rope_type +
                    "' is not supported (default, linear, llama3)");
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
    v.intermediate_size = static_cast<int64_t>(static_cast<double>(v.embed_dim) * read<double>(j, "mlp_ratio", where, 4.0));
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

}  // namespace

ModelConfig ModelConfig::from_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw UserError(path.string() + ": cannot open model config");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::parse_error& e) {
    throw UserError(path.string() + ": not valid JSON (" + e.what() + ")");
  }
  return from_json(j, path.string());
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
  if (read<bool>(j, "use_sliding_window", origin, false)) {
    throw UserError(origin + ": use_sliding_window = true is not supported");
  }
  if (c.hidden_act != "silu") {
    throw UserError(origin + ": hidden_act '" + c.hidden_act + "' is not supported (silu)");
  }
  for (auto [name, value] : {std::pair{"vocab_size", c.vocab_size},
                             {"intermediate_size", c.intermediate_size},
                             {"num_hidden_layers", c.num_hidden_layers},
                             {"num_key_value_heads", c.num_key_value_heads},
                             {"head_dim", c.head_dim}}) {
    if (value <= 0) throw UserError(origin + ": " + name + " must be positive");
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    throw UserError(origin + ": num_attention_heads " + std::to_string(c.num_attention_heads) +
                    " is not a multiple of num_key_value_heads " +
                    std::to_string(c.num_key_value_heads));
  }
  if (c.head_dim % 2 != 0) {
    throw UserError(origin + ": head_dim " + std::to_string(c.head_dim) + " must be even for RoPE");
  }
  if (file.contains("vision_config")) {
    if (!file["vision_config"].is_object()) throw UserError(origin + ": vision_config is not an object");
    c.vision = read_vision(file["vision_config"], c.model_type, origin);
    c.image_token_id = read<int64_t>(file, "image_token_id", origin, -1, true);
    c.video_token_id = read<int64_t>(file, "video_token_id", origin, -1, true);
    c.vision_start_token_id = read<int64_t>(file, "vision_start_token_id", origin, -1, true);
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
