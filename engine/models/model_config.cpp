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

ModelConfig ModelConfig::from_json(const json& j, const std::string& origin) {
  if (!j.is_object()) throw UserError(origin + ": a model config must be a JSON object");
  ModelConfig c;
  c.model_type = read<std::string>(j, "model_type", origin, "", true);
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
  c.raw = std::make_shared<const json>(j);
  return c;
}

}  // namespace fsdpp
