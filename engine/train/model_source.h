// The [model] section: which architecture to build and where its weights come from.
#pragma once

#include "core/dtype.h"
#include "models/causal_lm.h"

#include <memory>
#include <string>

namespace fsdpp {

class ConfigSection;

struct ModelSourceConfig {
  std::string path;               // HF model directory, or a config.json for a fresh model
  std::string dtype = "float32";  // parameter dtype: float32, bfloat16, float16
  uint64_t init_seed = 0;         // seed of a fresh model's initialisation

  static ModelSourceConfig from_section(ConfigSection& section);
};

struct LoadedModel {
  std::shared_ptr<CausalLM> model;
  bool init_pending = false;  // built unallocated: the sharding must initialise it
};

// Builds the model; loads the directory's safetensors when it has any, else initialises
// from init_seed with the config's initializer_range, or, with `defer_fresh_init`, builds
// it unallocated (no memory) for FSDP to initialise shard by shard.
LoadedModel load_model(const ModelSourceConfig& config, bool defer_fresh_init = false);

}  // namespace fsdpp
