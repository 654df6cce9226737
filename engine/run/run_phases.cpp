// What a loop that alternates training with inference (RL, an engine beside the trainer on
// the same device) asks of the run between its phases: the state moved off the device and
// back, and the weights handed out whole, one unit at a time, gathered from the masters (a
// collective), LoRA adapters merged into their targets as fsdpp export --merge-lora merges
// them, so the names and values are the export's; and weights taken in whole (a reference
// model refreshed from the actor's).
#include "run/run.h"

#include "core/device.h"
#include "core/error.h"
#include "fsdp/fsdp_state.h"
#include "models/lora.h"

#include <ATen/ATen.h>

#include <map>

namespace fsdpp {

std::string Run::Offloaded::names() const {
  std::string text;
  for (auto [moved, name] : {std::pair{params, "params"}, {grads, "grads"}, {optimizer, "optimizer"}}) {
    if (moved) text += (text.empty() ? "" : ", ") + std::string(name);
  }
  return text;
}

void Run::offload(const Offloaded& what) {
  check_outside_backward("offload");
  if (offloaded_) {
    throw EveryRankError("offload: offload() moved the run's " + offloaded_->names() + " off the device already; "
                         "reload() first");
  }
  fsdp_->reshard_all();
  // Pinned on a GPU run, so the copies back run at full speed.
  const bool pinned = device_.is_cuda();
  for (const auto& unit : fsdp_->units()) {
    if (what.params) unit->move_shards(at::kCPU, pinned);
    if (what.grads) unit->move_grads(at::kCPU, pinned);
  }
  if (what.optimizer) optimizer_->move_state(c10::Device(at::kCPU), pinned);
  offloaded_ = what;
  release_cached_memory(device_);
}

void Run::reload() {
  if (!offloaded_) return;
  check_outside_backward("reload");
  const bool pinned = device_.is_cuda();
  for (const auto& unit : fsdp_->units()) {
    if (offloaded_->params) unit->move_shards(unit->home(), pinned);
    if (offloaded_->grads) unit->move_grads(unit->home(), pinned);
  }
  if (offloaded_->optimizer) optimizer_->move_state(std::nullopt, pinned);  // beside the shards again
  offloaded_.reset();
}

void Run::check_outside_backward(const char* what) const {
  if (fsdp_->in_backward()) {
    throw EveryRankError(std::string(what) + ": not from inside a backward through the units (a hook's call): the "
                         "backward still reads what it would replace; call it once backward() has returned");
  }
}

void Run::check_not_offloaded(const char* what, bool params_only) const {
  if (offloaded_ && (offloaded_->params || !params_only)) {
    throw EveryRankError(std::string(what) + ": offload() moved the run's " + offloaded_->names() +
                         " off the device; call reload() first");
  }
}

void Run::check_loaded(const char* what, bool params_only) const {
  check_not_offloaded(what, params_only);
  if (partly_loaded_from_) {
    throw EveryRankError(std::string(what) + ": the run holds part of " + partly_loaded_from_->string() +
                         " and part of its earlier state, since that load failed; load() a checkpoint in full first");
  }
}

std::vector<std::pair<std::string, at::Tensor>> Run::full_weights(size_t unit, at::ScalarType dtype) {
  check_loaded("full_weights", /*params_only=*/true);
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
  // A target's factors are its children, so they share its unit; a tied head's unit holds
  // the embedding too.
  std::map<std::string, at::Tensor> by_name(gathered.begin(), gathered.end());
  const auto merged = [&](const std::string& module, const at::Tensor& t) {
    const auto a = by_name.find(module + ".lora_A.weight"), b = by_name.find(module + ".lora_B.weight");
    return a != by_name.end() && b != by_name.end() ? merged_lora_weight(t, a->second, b->second, *lora).to(dtype)
                                                    : t.to(dtype);
  };
  for (const auto& [name, t] : gathered) {
    if (is_adapter_parameter(name)) continue;
    weights.emplace_back(name, name.ends_with(".weight") ? merged(name.substr(0, name.rfind('.')), t) : t.to(dtype));
  }
  if (const auto head = adapted_tied_head(model(), *lora); head && by_name.contains(*head)) {
    weights.emplace_back("lm_head.weight", merged("lm_head", by_name.at(*head)));
  }
  return weights;
}

void Run::check_weights(const std::vector<std::pair<std::string, at::Tensor>>& weights) {
  check_loaded("load_weights");
  check_outside_backward("load_weights");
  if (loaded_.lora) {
    throw UserError("load_weights: the run trains LoRA adapters over a frozen base, and full weights hold them "
                    "merged; load into a run without adapters");
  }
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& s : fsdp_->shard_rows()) shapes.emplace(s.name, s.full_shape);
  for (const auto& [name, value] : weights) {
    const auto shape = shapes.find(name);
    if (shape == shapes.end()) {
      throw UserError("load_weights: the model has no parameter '" + name + "'" +
                      (name == "lm_head.weight" && model().config().tie_word_embeddings
                           ? " (its head is tied to model.embed_tokens.weight, which full_weights gives)"
                           : ""));
    }
    if (value.sizes() != at::IntArrayRef(shape->second) || !at::isFloatingType(value.scalar_type())) {
      throw UserError("load_weights: '" + name + "' is " + std::string(c10::toString(value.scalar_type())) + " " +
                      c10::str(value.sizes()) + ", where the parameter is a floating " + c10::str(at::IntArrayRef(shape->second)));
    }
  }
}

void Run::load_weights(const std::vector<std::pair<std::string, at::Tensor>>& weights) {
  check_weights(weights);
  optimizer_->settle();   // the last step's host updates would write over the rows given
  fsdp_->reshard_all();  // the kept cast shards hold the old values
  std::map<std::string, at::Tensor> given(weights.begin(), weights.end());
  const at::NoGradGuard no_grad;
  for (auto& s : fsdp_->shard_rows()) {
    const auto value = given.find(s.name);
    if (value == given.end()) continue;
    // The rows of the full tensor this rank keeps, read as the flat run they are.
    int64_t row_numel = 1;
    for (size_t d = 1; d < s.full_shape.size(); ++d) row_numel *= s.full_shape[d];
    s.rows.copy_(value->second.reshape(-1).narrow(0, s.first_row * row_numel, s.rows.numel()).view(s.rows.sizes()));
  }
}

}  // namespace fsdpp
