// The run's weights handed out whole, for an inference engine beside the trainer: one unit
// at a time, gathered from the masters (a collective), LoRA adapters merged into their
// targets as fsdpp export --merge-lora merges them, so the names and values are the export's.
#include "run/run.h"

#include "fsdp/fsdp_state.h"
#include "models/lora.h"

#include <ATen/ATen.h>

#include <map>

namespace fsdpp {

std::vector<std::pair<std::string, at::Tensor>> Run::full_weights(size_t unit, at::ScalarType dtype) {
  const auto& units = fsdp_->units();
  TORCH_CHECK(unit < units.size(), "full_weights: unit ", unit, " of ", units.size());
  std::vector<std::pair<std::string, at::Tensor>> gathered;
  units[unit]->for_each_full_value([&](const std::string& name, const at::Tensor& t) { gathered.emplace_back(name, t); });
  std::vector<std::pair<std::string, at::Tensor>> weights;
  const auto& lora = loaded_.lora;
  if (!lora) {
    for (auto& [name, t] : gathered) weights.emplace_back(name, t.to(dtype));
    return weights;
  }
  // A target's factors are its children, so they share its unit.
  std::map<std::string, at::Tensor> by_name(gathered.begin(), gathered.end());
  for (const auto& [name, t] : gathered) {
    if (is_adapter_parameter(name)) continue;
    const std::string module = name.substr(0, name.rfind('.'));
    const auto a = by_name.find(module + ".lora_A.weight"), b = by_name.find(module + ".lora_B.weight");
    if (name.ends_with(".weight") && a != by_name.end() && b != by_name.end()) {
      weights.emplace_back(name, merged_lora_weight(t, a->second, b->second, *lora).to(dtype));
    } else {
      weights.emplace_back(name, t.to(dtype));
    }
  }
  return weights;
}

}  // namespace fsdpp
