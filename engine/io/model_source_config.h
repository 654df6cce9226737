// The [model] section: where the model comes from (an HF directory, a sharded checkpoint
// or a config.json) and the dtype its parameters are held in.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

namespace fsdpp {

class ConfigSection;

struct ModelSourceConfig {
  std::string path;               // HF model directory, sharded checkpoint, or a config.json for a fresh model
  // The model's dtype (float32, float64, bfloat16, float16): units compute in it unless the
  // policy sets their precision, and exports write it; masters, gradients and optimizer state
  // keep float32 (float64 for a float64 model).
  at::ScalarType dtype = at::kFloat;
  uint64_t init_seed = 0;         // seed of a fresh model's initialisation (and of new LoRA adapters)
  std::string adapter;            // a PEFT LoRA adapter directory to start from; "" for none

  static ModelSourceConfig from_section(ConfigSection& section);
};

}  // namespace fsdpp
