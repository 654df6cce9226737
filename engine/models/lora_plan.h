// Low-rank adapters as declared (a policy's lora{...}, a PEFT adapter's config, a
// checkpoint's record): model data, which the plan carries beside its units and every layer
// above the models reads. The record's one JSON reader and writer are here.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdpp {

// PEFT's LoRA: the listed Linear modules get adapters, the listed base modules keep training
// their own parameters, and the rest of the base is frozen.
struct LoraPlan {
  std::vector<std::string> targets;    // dotted paths of Linear modules
  int64_t rank = 0;                    // r
  double alpha = 0.0;                  // the adapter's output is scaled by alpha / r
  double dropout = 0.0;                // on the adapter's input, in training
  std::vector<std::string> trainable;  // base modules whose parameters stay trainable
  std::string origin;                  // where the policy declared it (file:line)
};

// Every field, as checkpoints record the adapters they hold.
void to_json(nlohmann::json& j, const LoraPlan& lora);
void from_json(const nlohmann::json& j, LoraPlan& lora);

}  // namespace fsdpp
