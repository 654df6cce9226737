// Building units over a model and the end-of-backward bookkeeping shared by them.
#include "fsdp/fsdp_state.h"

#include "core/error.h"
#include "models/causal_lm.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <set>

namespace fsdpp {

namespace {

bool under(const std::string& path, const std::string& prefix) {
  return prefix.empty() || path == prefix || path.starts_with(prefix + ".");
}

}  // namespace

FsdpState::FsdpState(Module& root, DeviceMesh mesh, std::optional<FreshInit> fresh_init)
    : root_(root), mesh_(std::move(mesh)), fresh_init_(fresh_init) {
  for (const auto& entry : named_modules(root_)) {
    for (const auto& item : entry.module->named_parameters(/*recurse=*/false)) {
      aliases_[item.value().unsafeGetTensorImpl()].push_back(
          entry.path.empty() ? item.key() : entry.path + "." + item.key());
    }
  }
}

FsdpState::~FsdpState() = default;

FsdpUnit& FsdpState::fully_shard(const std::vector<Module*>& modules, const UnitOptions& options) {
  TORCH_CHECK(!modules.empty(), "fully_shard needs at least one module");
  const auto all = named_modules(root_);
  std::vector<std::string> prefixes;
  for (Module* m : modules) {
    auto it = std::find_if(all.begin(), all.end(), [m](const ModuleEntry& e) { return e.module == m; });
    TORCH_CHECK(it != all.end(), "fully_shard: module ", m->class_name(), " is not in the model");
    prefixes.push_back(it->path);
  }
  auto covered = [&prefixes](const std::string& path) {
    return std::any_of(prefixes.begin(), prefixes.end(), [&](const auto& p) { return under(path, p); });
  };
  std::string name;
  for (const auto& p : prefixes) name += (name.empty() ? "" : "+") + (p.empty() ? std::string("<root>") : p);

  std::vector<ShardedParam> params;
  for (const auto& entry : all) {
    if (!covered(entry.path)) continue;
    for (const auto& item : entry.module->named_parameters(/*recurse=*/false)) {
      const void* impl = item.value().unsafeGetTensorImpl();
      if (claimed_.count(impl)) continue;
      const auto& paths = aliases_[impl];
      for (const auto& alias : paths) {
        if (!covered(alias)) {
          throw UserError("tied parameters " + paths.front() + " and " + alias +
                          " must be in one unit, but unit " + name + " holds only the first");
        }
      }
      claimed_[impl] = name;
      std::function<void(at::Tensor&)> fill;
      if (fresh_init_) {
        // The same generator init_parameters would use: values depend on the name alone.
        fill = [this, &entry, &item, &paths](at::Tensor& full) {
          at::NoGradGuard no_grad;
          at::Generator gen = named_generator(fresh_init_->seed, paths.front());
          entry.module->init_parameter(item.key(), full, gen, fresh_init_->std);
        };
      }
      params.emplace_back(paths.front(), item.value(), mesh_.shard_group->rank(), mesh_.shard_group->size(), fill);
    }
  }
  units_.push_back(std::make_unique<FsdpUnit>(name, modules, std::move(params), mesh_.shard_group,
                                              mesh_.replicate_group, options, this));
  return *units_.back();
}

FsdpUnit& FsdpState::shard_root(const UnitOptions& options) { return fully_shard({&root_}, options); }

std::vector<NamedParameter> FsdpState::sharded_parameters() const {
  std::vector<NamedParameter> out;
  for (const auto& unit : units_) {
    for (const auto& p : unit->params()) out.push_back({p.name, p.owned});
  }
  return out;
}

void FsdpState::for_each_full_parameter(const std::function<void(const std::string&, const at::Tensor&)>& visit) {
  for (const auto& unit : units_) {
    const bool was_unsharded = unit->is_unsharded();
    unit->unshard();
    for (const auto& p : unit->params()) visit(p.name, p.param.detach());
    if (!was_unsharded) unit->reshard();
  }
}

void FsdpState::reshard_all() {
  for (auto& unit : units_) unit->reshard();
}

void FsdpState::on_pre_backward() {
  if (in_backward_) return;
  in_backward_ = true;
  torch::autograd::Engine::get_default_engine().queue_callback([this] { final_callback(); });
}

void FsdpState::final_callback() {
  // Units whose inputs needed no gradient (the root, an embedding) never saw their
  // post-backward fire; reduce them now, in the same order on every rank.
  for (auto it = units_.rbegin(); it != units_.rend(); ++it) (*it)->post_backward();
  for (auto& unit : units_) unit->end_backward();
  in_backward_ = false;
}

std::unique_ptr<FsdpState> shard_default(CausalLM& model, DeviceMesh mesh, const UnitOptions& layer_options,
                                         std::optional<FreshInit> fresh_init) {
  auto state = std::make_unique<FsdpState>(model, std::move(mesh), fresh_init);
  const auto& no_split = model.no_split_modules();
  const bool tied = model.config().tie_word_embeddings;
  for (const auto& entry : named_modules(model)) {
    const auto& cls = entry.module->class_name();
    const bool block = std::find(no_split.begin(), no_split.end(), cls) != no_split.end();
    if (block) state->fully_shard({entry.module}, layer_options);
    if (cls == "Embedding" && !tied) {
      state->fully_shard({entry.module}, {.reshard_after_forward = layer_options.reshard_after_forward});
    }
  }
  // The root's parameters (final norm, lm_head) are used last in forward and first in
  // backward, so keeping them gathered saves one all-gather per step.
  state->shard_root({.reshard_after_forward = false});
  return state;
}

}  // namespace fsdpp
