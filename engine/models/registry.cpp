// The model registry. New architectures add one entry here.
#include "models/registry.h"

#include "core/error.h"
#include "models/decoder.h"
#include "models/qwen_vl.h"

#include <map>

namespace fsdpp {

namespace {

ModelBuilder decoder_builder(DecoderFamily family) {
  return [family](const ModelConfig& config, const torch::TensorOptions& opts) {
    return std::make_shared<DecoderCausalLM>(family, config, opts);
  };
}

std::shared_ptr<CausalLM> vision_language_builder(const ModelConfig& config, const torch::TensorOptions& opts) {
  return std::make_shared<VisionLanguageLM>(config, opts);
}

const std::map<std::string, ModelBuilder>& registry() {
  static const std::map<std::string, ModelBuilder> builders = {
      {"llama", decoder_builder({.prefix = "Llama"})},
      {"mistral", decoder_builder({.prefix = "Mistral"})},
      {"qwen2", decoder_builder({.prefix = "Qwen2", .qkv_bias = true})},
      {"qwen3", decoder_builder({.prefix = "Qwen3", .qk_norm = true})},
      {"qwen3_moe", decoder_builder({.prefix = "Qwen3Moe", .qk_norm = true})},
      {"deepseek_v3", decoder_builder({.prefix = "DeepseekV3"})},
      {"qwen2_vl", vision_language_builder},
      {"qwen2_5_vl", vision_language_builder},
  };
  return builders;
}

}  // namespace

std::shared_ptr<CausalLM> build_model(const ModelConfig& config, const torch::TensorOptions& opts) {
  auto it = registry().find(config.model_type);
  if (it == registry().end()) {
    std::string known;
    for (const auto& type : registered_model_types()) known += (known.empty() ? "" : ", ") + type;
    throw UserError("model_type '" + config.model_type + "' is not supported (known: " + known + ")");
  }
  return it->second(config, opts);
}

std::string architecture_of(const ModelConfig& config) {
  return build_model(config, torch::TensorOptions().device(torch::kMeta))->class_name();
}

std::vector<std::string> registered_model_types() {
  std::vector<std::string> types;
  for (const auto& [type, builder] : registry()) types.push_back(type);
  return types;
}

}  // namespace fsdpp
