// Attaching adapters and freezing the base.
#include "models/lora.h"

#include "core/error.h"
#include "core/log.h"
#include "core/module_tree.h"
#include "models/layers.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <vector>

namespace fsdpp {

namespace {

constexpr const char* kPeftPrefix = "base_model.model.";
// Engine path prefix -> transformers 5's module path prefix, for the vision-language models.
// No other model has a module under model.language_model or model.visual, so reading maps
// back whatever the model.
const std::pair<std::string, std::string> kVisionLanguagePaths[] = {{"model.", "model.language_model."},
                                                                    {"visual.", "model.visual."}};

// A weight two modules share (tied embeddings) cannot train as a module PEFT saves whole:
// PEFT keeps a copy of each such module apart, untying them, and one of the two would
// otherwise stay frozen by the other's place outside the list.
void refuse_tied_trainable(CausalLM& model, const LoraPlan& lora, const std::string& where) {
  std::map<const c10::TensorImpl*, std::vector<std::string>> holders;  // weight -> parameter names
  for (const auto& e : named_modules(model)) {
    for (auto& item : e.module->named_parameters(/*recurse=*/false)) {
      holders[item.value().unsafeGetTensorImpl()].push_back(e.path.empty() ? item.key() : e.path + "." + item.key());
    }
  }
  for (const auto& [weight, names] : holders) {
    if (names.size() < 2) continue;
    for (const auto& name : names) {
      for (const auto& t : lora.trainable) {
        if (!path_under(name, t)) continue;
        throw UserError(where + ": lora: trainable module '" + t + "' holds " + name + ", which is tied to " +
                        (name == names[0] ? names[1] : names[0]) +
                        " (tie_word_embeddings): a tied weight cannot train beside adapters; leave it frozen");
      }
    }
  }
}

// An adapter of rank at or above a weight's smaller side holds more numbers than the weight and
// can express no more than training it whole: allowed, but rarely what was meant.
void warn_if_rank_not_low(const std::map<std::string, Module*>& by_path, const LoraPlan& lora,
                          const std::string& where) {
  std::vector<std::string> full;
  for (const auto& path : lora.targets) {
    const auto& weight = dynamic_cast<Linear*>(by_path.at(path))->weight;  // [out, in]
    if (lora.rank >= std::min(weight.size(0), weight.size(1))) {
      full.push_back(module_label(path) + " [" + std::to_string(weight.size(0)) + ", " +
                     std::to_string(weight.size(1)) + "]");
    }
  }
  if (full.empty()) return;
  log_warn(where, ": lora: rank ", lora.rank, " is not below the smaller side of ", full.size(), " of the ",
           lora.targets.size(), " targets (", full.front(), full.size() > 1 ? ", ..." : "",
           "): their adapters hold more numbers than those weights and can express no more than training them whole");
}

}  // namespace

void apply_lora(CausalLM& model, const LoraPlan& lora, const torch::TensorOptions& opts) {
  const std::string where = lora.origin.empty() ? "lora" : lora.origin;
  std::map<std::string, Module*> by_path;
  for (const auto& e : named_modules(model)) by_path[e.path] = e.module;
  for (const auto& path : lora.targets) {
    auto it = by_path.find(path);
    if (it == by_path.end()) throw UserError(where + ": lora: no module at path '" + module_label(path) + "'");
    auto* linear = dynamic_cast<Linear*>(it->second);
    if (linear == nullptr || dynamic_cast<LoraFactor*>(it->second) != nullptr) {
      throw UserError(where + ": lora: target '" + module_label(path) + "' is a " + it->second->class_name() +
                      ", not a Linear module");
    }
    if (linear->has_adapter()) throw UserError(where + ": lora: target '" + module_label(path) + "' is listed twice");
    linear->add_adapter(lora.rank, lora.alpha, lora.dropout, opts);
  }
  warn_if_rank_not_low(by_path, lora, where);
  for (const auto& path : lora.trainable) {
    if (!by_path.count(path)) {
      throw UserError(where + ": lora: no trainable module at path '" + module_label(path) + "'");
    }
    // PEFT saves a trainable module whole (modules_to_save) and loads it as a plain copy, so an
    // adapter inside it would be dropped on loading, or refused where every target is inside.
    for (const auto& target : lora.targets) {
      if (!path_under(target, path)) continue;
      throw UserError(where + ": lora: trainable module '" + module_label(path) + "' " +
                      (target == path ? "is" : "holds") + " the target '" + target +
                      "': PEFT would load the adapter without it; adapt a module or train it whole, not both");
    }
  }
  refuse_tied_trainable(model, lora, where);
  for (const auto& e : named_modules(model)) {
    const bool trainable = std::any_of(lora.trainable.begin(), lora.trainable.end(),
                                       [&](const std::string& t) { return path_under(e.path, t); });
    for (auto& item : e.module->named_parameters(/*recurse=*/false)) {
      const std::string name = e.path.empty() ? item.key() : e.path + "." + item.key();
      // A parameter frozen by its model (a routing bias) stays frozen.
      if (!is_adapter_parameter(name) && !trainable) item.value().set_requires_grad(false);
    }
  }
}

at::Tensor merged_lora_weight(const at::Tensor& base, const at::Tensor& a, const at::Tensor& b, const LoraPlan& lora) {
  return base.to(at::kDouble) + at::matmul(b.to(at::kDouble), a.to(at::kDouble)) * (lora.alpha / static_cast<double>(lora.rank));
}

bool is_adapter_parameter(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

std::string peft_module_path(const std::string& path, const std::string& model_type) {
  if (model_type != "qwen2_vl" && model_type != "qwen2_5_vl") return path;
  for (const auto& [engine, module] : kVisionLanguagePaths) {
    if (path.starts_with(engine)) return module + path.substr(engine.size());
  }
  return path;
}

std::string peft_tensor_name(const std::string& name, const std::string& model_type) {
  return kPeftPrefix + peft_module_path(name, model_type);
}

std::string engine_module_path(const std::string& peft_path) {
  for (const auto& [engine, module] : kVisionLanguagePaths) {
    if (peft_path.starts_with(module)) return engine + peft_path.substr(module.size());
  }
  return peft_path;
}

std::string engine_tensor_name(const std::string& peft_name) {
  return engine_module_path(peft_name.starts_with(kPeftPrefix) ? peft_name.substr(std::string(kPeftPrefix).size())
                                                               : peft_name);
}

void to_json(nlohmann::json& j, const LoraPlan& lora) {
  j = {{"targets", lora.targets}, {"rank", lora.rank},           {"alpha", lora.alpha},
       {"dropout", lora.dropout}, {"trainable", lora.trainable}, {"origin", lora.origin}};
}

void from_json(const nlohmann::json& j, LoraPlan& lora) {
  j.at("targets").get_to(lora.targets);
  j.at("rank").get_to(lora.rank);
  j.at("alpha").get_to(lora.alpha);
  j.at("dropout").get_to(lora.dropout);
  j.at("trainable").get_to(lora.trainable);
  j.at("origin").get_to(lora.origin);
}

std::optional<std::string> adapted_tied_head(Module& model, const LoraPlan& lora) {
  if (std::find(lora.targets.begin(), lora.targets.end(), "lm_head") == lora.targets.end()) return {};
  for (const auto& group : tied_parameter_groups(model)) {
    if (std::find(group.begin(), group.end(), "lm_head.weight") == group.end()) continue;
    for (const auto& name : group) {
      if (name != "lm_head.weight") return name;
    }
  }
  return {};
}

}  // namespace fsdpp
