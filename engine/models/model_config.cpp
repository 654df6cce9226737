// Parsing and validation of Hugging Face config.json files.
#include "models/model_config.h"

#include "core/error.h"
#include "core/json_text.h"
#include "core/mapped_file.h"
#include "models/config_fields.h"
#include "models/config_sections.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <tuple>
#include <utility>

namespace fsdpp {

using nlohmann::json;
using namespace config_fields;

bool MoeConfig::is_moe_layer(int64_t layer) const {
  if (routing == Routing::grouped_sigmoid) return layer >= first_k_dense_replace;
  return (layer + 1) % decoder_sparse_step == 0 &&
         std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) == mlp_only_layers.end();
}

ModelConfig ModelConfig::from_file(const std::filesystem::path& path) {
  return from_text(read_text_file(path), path.string());
}

ModelConfig ModelConfig::from_text(const std::string& text, const std::string& origin) {
  return from_json(parse_json(text, origin), origin);
}

namespace {

// transformers' defaults that differ between model types (its config classes).
struct TypeDefaults {
  int64_t max_position_embeddings;
  double rope_theta;
  int64_t num_key_value_heads;  // 0: num_attention_heads
  double rms_norm_eps;
};

TypeDefaults defaults_of(const std::string& model_type) {
  if (model_type == "llama") return {2048, 1e4, 0, 1e-6};
  if (model_type == "mistral") return {131072, 1e4, 8, 1e-6};
  if (model_type == "qwen3_moe") return {32768, 1e4, 4, 1e-6};
  if (model_type == "deepseek_v3") return {4096, 1e4, 128, 1e-6};
  if (model_type == "qwen2_vl" || model_type == "qwen2_5_vl") return {32768, 1e6, 8, 1e-5};
  return {32768, 1e4, 32, 1e-6};  // qwen2, qwen3
}

// RoPE's base and frequency scaling, from wherever the file's transformers version put them.
void read_rope(const json& j, const std::string& origin, ModelConfig& c, double default_theta) {
  const RopeBlock rope = read_rope_block(j, origin);
  c.rope_theta = read<double>(rope.values, "rope_theta", origin + ": " + rope.name, default_theta);
  c.rope_scaling = read_rope_scaling(rope, origin);
}

// Mistral's window applies whenever it is set; Qwen2's configs carry one that applies only
// with use_sliding_window, which is refused. transformers 5 also lists each layer's
// attention (layer_types): here every layer attends alike, windowed where a window is set.
void read_attention_window(const json& j, const std::string& origin, ModelConfig& c) {
  if (c.model_type == "mistral") {
    c.sliding_window = read_nullable<int64_t>(j, "sliding_window", origin, 4096, 0);  // null: no window
    if (c.sliding_window != 0) check_range(origin, "sliding_window", c.sliding_window, 1, kMaxPositions);
  }
  if (read<bool>(j, "use_sliding_window", origin, false)) {
    throw UserError(origin + ": use_sliding_window = true is not supported");
  }
  // Attention probabilities are never dropped here: a config that drops them would train
  // another model than the file describes.
  if (const double dropout = read<double>(j, "attention_dropout", origin, 0.0); dropout != 0.0) {
    throw UserError(origin + ": attention_dropout " + json(dropout).dump() + " is not supported (0.0)");
  }
  const std::string every = c.sliding_window != 0 ? "sliding_attention" : "full_attention";
  const auto layer_types = read<std::vector<std::string>>(j, "layer_types", origin, {});
  for (size_t i = 0; i < layer_types.size(); ++i) {
    if (layer_types[i] != every) {
      throw UserError(origin + ": layer_types[" + std::to_string(i) + "] '" + layer_types[i] +
                      "' is not supported (every layer '" + every + "' here)");
    }
  }
}

// The decoder's own fields, with the model type's sections (experts, latent attention).
void read_decoder(const json& j, const std::string& origin, ModelConfig& c) {
  c.vocab_size = read<int64_t>(j, "vocab_size", origin, 0, true);
  c.hidden_size = read<int64_t>(j, "hidden_size", origin, 0, true);
  c.intermediate_size = read<int64_t>(j, "intermediate_size", origin, 0, true);
  c.num_hidden_layers = read<int64_t>(j, "num_hidden_layers", origin, 0, true);
  c.num_attention_heads = read<int64_t>(j, "num_attention_heads", origin, 0, true);
  const TypeDefaults defaults = defaults_of(c.model_type);
  c.num_key_value_heads = read<int64_t>(j, "num_key_value_heads", origin,
                                        defaults.num_key_value_heads != 0 ? defaults.num_key_value_heads
                                                                          : c.num_attention_heads);
  if (c.num_attention_heads <= 0 || c.hidden_size <= 0) {
    throw UserError(origin + ": hidden_size and num_attention_heads must be positive");
  }
  // Qwen3's config class fixes 128; the others derive it.
  const int64_t head_dim = c.model_type == "qwen3" ? 128 : c.hidden_size / c.num_attention_heads;
  c.head_dim = read_nullable<int64_t>(j, "head_dim", origin, head_dim, c.hidden_size / c.num_attention_heads);
  // A head width derived from the others must split the residual stream evenly, as
  // transformers requires; a file that gives head_dim may choose any.
  const bool derived = j.value("head_dim", json()).is_null() && (j.contains("head_dim") || c.model_type != "qwen3");
  if (derived && c.model_type != "deepseek_v3" && c.hidden_size % c.num_attention_heads != 0) {
    throw UserError(origin + ": hidden_size " + std::to_string(c.hidden_size) + " is not a multiple of " +
                    "num_attention_heads " + std::to_string(c.num_attention_heads) + ", and no head_dim says how wide a head is");
  }
  c.max_position_embeddings = read<int64_t>(j, "max_position_embeddings", origin, defaults.max_position_embeddings);
  c.rms_norm_eps = read<double>(j, "rms_norm_eps", origin, defaults.rms_norm_eps);
  read_rope(j, origin, c, defaults.rope_theta);
  c.tie_word_embeddings = read<bool>(j, "tie_word_embeddings", origin, false);
  // Checked against a vocabulary that is there; check_decoder refuses any other.
  if (auto pad = j.find("pad_token_id"); pad != j.end() && !pad->is_null() && c.vocab_size > 0) {
    const int64_t id = read<int64_t>(j, "pad_token_id", origin, 0);
    check_range(origin, "pad_token_id", id, -c.vocab_size, c.vocab_size - 1);
    c.padding_row = id < 0 ? id + c.vocab_size : id;
  }
  // transformers' classes honour only some bias switches: Llama both, Qwen3, Qwen3-MoE and
  // DeepSeek-V3 attention_bias alone, Mistral and the Qwen2 family neither (Qwen2's q/k/v
  // always carry one: DecoderFamily::qkv_bias). A switch its class ignores is ignored here,
  // so a file builds the model transformers builds from it.
  const std::string& type = c.model_type;
  if (type == "llama" || type == "qwen3" || type == "qwen3_moe" || type == "deepseek_v3") {
    c.attention_bias = read<bool>(j, "attention_bias", origin, false);
  }
  if (type == "llama") c.mlp_bias = read<bool>(j, "mlp_bias", origin, false);
  c.initializer_range = read<double>(j, "initializer_range", origin, 0.02);
  check_between(origin, "initializer_range", c.initializer_range, 0, 10);
  c.hidden_act = read<std::string>(j, "hidden_act", origin, "silu");
  read_attention_window(j, origin, c);
  if (c.model_type == "qwen3_moe") c.moe = read_qwen3_moe(j, c.num_hidden_layers, origin);
  if (c.model_type == "deepseek_v3") {
    c.moe = read_deepseek_moe(j, c.num_hidden_layers, origin);
    c.latent_attention = read_latent_attention(j, origin);
    c.head_dim = c.latent_attention->qk_rope_head_dim;  // what RoPE rotates, as transformers sets it
  }
  RopeScaling& rope = c.rope_scaling;
  if (rope.original_max_position_embeddings == 0) rope.original_max_position_embeddings = c.max_position_embeddings;
  if (rope.factor == 0.0) {  // YaRN's factor left null: derived as transformers derives it
    rope.factor = static_cast<double>(c.max_position_embeddings) / static_cast<double>(rope.original_max_position_embeddings);
  }
}

// The output head the file's architectures name: a language model's lm_head [V, C], or a
// sequence-classification model's score [labels, C] (reward models and critics are saved so),
// which is never tied to the embedding, whatever tie_word_embeddings says. The other heads
// checkpoints name (token classification, question answering, custom reward and value heads)
// are refused.
void read_head(const json& file, const std::string& origin, ModelConfig& c) {
  if (!file.contains("architectures") || !file["architectures"].is_array()) return;
  for (const json& name : file["architectures"]) {
    if (!name.is_string()) continue;
    const std::string architecture = name.get<std::string>();
    for (const char* suffix : {"ForTokenClassification", "ForQuestionAnswering", "ForRewardModel", "WithValueHead"}) {
      if (architecture.ends_with(suffix)) {
        throw UserError(origin + ": architectures names " + architecture + ", whose head fsdpp does not build (it "
                        "builds ...ForCausalLM, ...ForConditionalGeneration and ...ForSequenceClassification models)");
      }
    }
    if (!architecture.ends_with("ForSequenceClassification")) continue;
    // transformers takes num_labels where the file gives it (over an id2label of another
    // size), else id2label's size, else 2.
    const auto labels = file.find("id2label");
    const int64_t listed = labels != file.end() && labels->is_object() && !labels->empty()
                               ? static_cast<int64_t>(labels->size())
                               : 2;
    c.num_labels = read<int64_t>(file, "num_labels", origin, listed);
    check_range(origin, "num_labels", c.num_labels, 1, int64_t{1} << 20);
    if (c.vision) throw UserError(origin + ": " + architecture + ": a vision-language model with a score head is not built");
    c.tie_word_embeddings = false;
  }
}

// Refuses a model past kMaxParameters before anything is built, counting each layer's
// attention (latent attention's low-rank projections) and MLP (every routed and shared
// expert's), the embeddings, and a vision tower's blocks, merger and patch embedding.
void check_parameter_count(const ModelConfig& c, const std::string& origin) {
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  const double h = d(c.hidden_size), heads = d(c.num_attention_heads);
  double attention = h * (2 * heads * d(c.head_dim) + 2 * d(c.num_key_value_heads) * d(c.head_dim));
  if (const auto& a = c.latent_attention) {
    const double q_head = d(a->qk_nope_head_dim + a->qk_rope_head_dim);
    attention = (a->q_lora_rank > 0 ? h * d(a->q_lora_rank) + d(a->q_lora_rank) * heads * q_head : h * heads * q_head) +
                h * d(a->kv_lora_rank + a->qk_rope_head_dim) +
                d(a->kv_lora_rank) * heads * d(a->qk_nope_head_dim + a->v_head_dim) + heads * d(a->v_head_dim) * h;
  }
  const double mlp = c.moe ? d(c.moe->num_experts + c.moe->n_shared_experts) * d(c.moe->moe_intermediate_size)
                           : d(c.intermediate_size);
  double parameters = d(c.num_hidden_layers) * (attention + 3 * h * mlp) + 2 * h * d(c.vocab_size);
  if (const auto& v = c.vision) {
    const double width = d(v->embed_dim), merged = width * d(v->spatial_merge_size) * d(v->spatial_merge_size);
    parameters += d(v->depth) * (4 * width * width + 3 * width * d(v->intermediate_size)) + merged * merged +
                  merged * d(v->out_hidden_size) +
                  width * d(v->in_channels) * d(v->temporal_patch_size) * d(v->patch_size) * d(v->patch_size);
  }
  if (parameters > kMaxParameters) {
    throw UserError(origin + ": describes a model of about " + std::to_string(static_cast<int64_t>(parameters / 1e9)) +
                    "B parameters, more than the " + std::to_string(static_cast<int64_t>(kMaxParameters / 1e9)) +
                    "B this engine builds");
  }
}

void check_decoder(const ModelConfig& c, const std::string& origin) {
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
  check_rope_theta(origin, c.rope_theta);
  if (c.initializer_range < 0) throw UserError(origin + ": initializer_range must not be negative");
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    throw UserError(origin + ": num_attention_heads " + std::to_string(c.num_attention_heads) +
                    " is not a multiple of num_key_value_heads " +
                    std::to_string(c.num_key_value_heads));
  }
  if (c.head_dim % 2 != 0) {
    throw UserError(origin + ": head_dim " + std::to_string(c.head_dim) + " must be even for RoPE");
  }
}

// A vision-language file's tower, its placeholder tokens and the multimodal RoPE sections.
void read_vision_language(const json& file, const std::string& origin, ModelConfig& c) {
  const bool vision_language = c.model_type == "qwen2_vl" || c.model_type == "qwen2_5_vl";
  if (vision_language && !file.contains("vision_config")) {
    throw UserError(origin + ": model_type '" + c.model_type + "' needs a vision_config");
  }
  if (!file.contains("vision_config")) return;
  if (!file["vision_config"].is_object()) throw UserError(origin + ": vision_config is not an object");
  c.vision = read_vision(file["vision_config"], c.model_type, origin);
  // The merger's output takes the place of image tokens' embeddings.
  if (c.vision->out_hidden_size != c.hidden_size) {
    throw UserError(origin + ": vision_config's output width " + std::to_string(c.vision->out_hidden_size) +
                    " (" + (c.model_type == "qwen2_vl" ? "hidden_size" : "out_hidden_size") +
                    ") differs from the language model's hidden_size " + std::to_string(c.hidden_size));
  }
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

}  // namespace

std::vector<std::string> ModelConfig::differences(const ModelConfig& other) const {
  std::vector<std::string> out;
  const auto compare = [&](const char* name, const auto& mine, const auto& theirs) {
    if (mine != theirs) out.push_back(std::string(name) + " " + json(mine).dump() + " -> " + json(theirs).dump());
  };
  compare("model_type", model_type, other.model_type);
  for (auto [name, a, b] : {std::tuple{"vocab_size", vocab_size, other.vocab_size},
                            {"hidden_size", hidden_size, other.hidden_size},
                            {"intermediate_size", intermediate_size, other.intermediate_size},
                            {"num_hidden_layers", num_hidden_layers, other.num_hidden_layers},
                            {"num_attention_heads", num_attention_heads, other.num_attention_heads},
                            {"num_key_value_heads", num_key_value_heads, other.num_key_value_heads},
                            {"head_dim", head_dim, other.head_dim},
                            {"sliding_window", sliding_window, other.sliding_window},
                            {"pad_token_id", padding_row, other.padding_row},
                            {"num_labels", num_labels, other.num_labels},
                            {"image_token_id", image_token_id, other.image_token_id},
                            {"video_token_id", video_token_id, other.video_token_id},
                            {"vision_start_token_id", vision_start_token_id, other.vision_start_token_id}}) {
    compare(name, a, b);
  }
  compare("rms_norm_eps", rms_norm_eps, other.rms_norm_eps);
  compare("rope_theta", rope_theta, other.rope_theta);
  compare("tie_word_embeddings", tie_word_embeddings, other.tie_word_embeddings);
  compare("attention_bias", attention_bias, other.attention_bias);
  compare("mlp_bias", mlp_bias, other.mlp_bias);
  compare("hidden_act", hidden_act, other.hidden_act);
  // Unscaled RoPE reads none of the scaling's fields but the multimodal sections.
  const bool plain = rope_scaling.rope_type == RopeType::plain && other.rope_scaling.rope_type == RopeType::plain;
  const bool same_rope = plain ? rope_scaling.mrope_section == other.rope_scaling.mrope_section
                               : rope_scaling == other.rope_scaling;
  for (auto [name, same] : {std::pair{"rope_scaling", same_rope},
                            {"experts", moe == other.moe},
                            {"latent attention", latent_attention == other.latent_attention},
                            {"vision_config", vision == other.vision}}) {
    if (!same) out.push_back(name);
  }
  return out;
}

const std::vector<std::string>& supported_model_types() {
  static const std::vector<std::string> types = {"deepseek_v3", "llama",    "mistral",  "qwen2",
                                                 "qwen2_5_vl",  "qwen2_vl", "qwen3",    "qwen3_moe"};
  return types;
}

ModelConfig ModelConfig::from_json(const json& file, const std::string& origin) {
  if (!file.is_object()) throw UserError(origin + ": a model config must be a JSON object");
  ModelConfig c;
  c.model_type = read<std::string>(file, "model_type", origin, "", true);
  // Before any field: another architecture's file lacks this one's keys, which is not its fault.
  const auto& types = supported_model_types();
  if (std::find(types.begin(), types.end(), c.model_type) == types.end()) {
    std::string known;
    for (const auto& type : types) known += (known.empty() ? "" : ", ") + type;
    throw UserError(origin + ": model_type '" + c.model_type + "' is not supported (known: " + known + ")");
  }
  // The weights' dtype is [model] dtype's to choose; the file's two names for it must agree.
  read<std::string>(file, spelled_key(file, {"dtype", "torch_dtype"}, origin), origin, "");
  // Multimodal files keep the language model's keys in text_config (older ones at the top).
  // Where text_config is there, transformers reads the language model from it alone, its
  // defaults filling what it lacks, whatever the top level says besides.
  json j = file;
  if (file.contains("text_config") && file["text_config"].is_object()) {
    j = file["text_config"];
    // Files before transformers 5 tie the embeddings in text_config, 5.x at the top: either ties.
    if (read<bool>(file, "tie_word_embeddings", origin, false)) j["tie_word_embeddings"] = true;
  }
  read_decoder(j, origin, c);
  check_decoder(c, origin);
  read_vision_language(file, origin, c);
  read_head(file, origin, c);
  check_parameter_count(c, origin);
  c.raw = std::make_shared<const json>(file);
  return c;
}

}  // namespace fsdpp
