// Resolving wrap plans against the model: which unit owns each parameter, on which mesh,
// and what each rank holds.
#include "fsdp/plan.h"

#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
#include "core/module_tree.h"
#include "fsdp/sharded_param.h"

#include <algorithm>
#include <map>
#include <set>

namespace fsdpp {

namespace {

int depth(const UnitPlan& unit) {
  int d = 1 << 20;
  for (const auto& path : unit.modules) {
    d = std::min(d, path.empty() ? -1 : static_cast<int>(std::count(path.begin(), path.end(), '.')));
  }
  return d;
}

std::string where(const UnitPlan& unit) { return unit.origin.empty() ? "plan" : unit.origin; }

// A unit's hooks run around its modules' forwards: a container has none of its own (its
// owner calls each child), so its parameters would never be gathered.
void check_has_forward(const UnitPlan& unit, const std::string& path, const Module& module) {
  if (module.is_container()) {
    throw UserError(where(unit) + ": module '" + path + "' is a " + module.class_name() +
                    ", which has no forward of its own (its owner calls each child): wrap its children");
  }
}

// The plan's units with the root added when the plan lacks one, each checked for paths that
// exist and modules wrapped once.
// A unit whose modules' parameters all belong to units inside it gathers nothing and is left
// out, as fully_shard on such a module does nothing. What it declares for its forward
// (checkpointing, precision, offload) would then apply to nothing: such a unit is refused.
void refuse_if_declares_more(const UnitPlan& unit) {
  const bool declares = unit.activation_checkpoint || unit.param_dtype || unit.reduce_dtype || unit.output_dtype ||
                        unit.compute != ProductPrecision::param || unit.offload != Offload::none;
  if (!declares) return;
  std::string modules;
  for (const auto& m : unit.modules) modules += (modules.empty() ? "" : ", ") + (m.empty() ? std::string("the root") : m);
  throw UserError(where(unit) + ": wrap of " + modules + ": every parameter under it belongs to a unit inside it, so it " +
                  "has none of its own to gather and is left out, and its activation_checkpoint, precision and " +
                  "offload would apply to nothing; declare them on the units inside it, or wrap it alone");
}

std::vector<UnitPlan> units_with_root(const Plan& plan, const std::map<std::string, Module*>& by_path) {
  if (plan.units.empty()) throw UserError("policy wrapped nothing: no module matched any of its rules");
  std::vector<UnitPlan> units = plan.units;
  const bool has_root = std::any_of(units.begin(), units.end(), [](const UnitPlan& u) {
    return std::find(u.modules.begin(), u.modules.end(), "") != u.modules.end();
  });
  if (!has_root) {
    // The root's leftovers (final norm, lm_head) are used last in forward and first in
    // backward: keeping them gathered saves an all-gather per step.
    units.push_back({.modules = {""}, .reshard_after_forward = 1, .mesh = units.front().mesh,
                     .origin = "root (implicit)"});
  }
  std::map<std::string, std::string> wrapped;  // module path -> unit origin
  for (const auto& unit : units) {
    if (unit.modules.empty()) throw UserError(where(unit) + ": wrap of an empty module list");
    for (const auto& path : unit.modules) {
      if (!by_path.count(path)) throw UserError(where(unit) + ": no module at path '" + path + "'");
      check_has_forward(unit, path, *by_path.at(path));
    }
    claim_modules(unit, wrapped);
  }
  return units;
}

}  // namespace

void claim_modules(const UnitPlan& unit, std::map<std::string, std::string>& wrapped) {
  // In sets: a unit may list many modules.
  const std::set<std::string> listed(unit.modules.begin(), unit.modules.end());
  if (listed.size() < unit.modules.size()) {
    for (auto it = unit.modules.begin(); it != unit.modules.end(); ++it) {
      if (std::find(it + 1, unit.modules.end(), *it) != unit.modules.end()) {
        throw UserError(where(unit) + ": one wrap lists module '" + module_label(*it) + "' twice");
      }
    }
  }
  for (const auto& path : unit.modules) {
    for (std::string above = path; !above.empty();) {  // each module above `path`, up to the root ""
      const size_t dot = above.rfind('.');
      above = dot == std::string::npos ? "" : above.substr(0, dot);
      if (listed.count(above)) {
        throw UserError(where(unit) + ": one wrap lists '" + path + "' and '" + module_label(above) +
                        "', which holds it; list either, or wrap the inner one in a unit of its own");
      }
    }
    if (const auto it = wrapped.find(path); it != wrapped.end()) {
      throw UserError(where(unit) + ": module '" + module_label(path) + "' is already wrapped by " + it->second);
    }
  }
  for (const auto& path : unit.modules) wrapped.emplace(path, where(unit));
}

namespace {

// The unit's options in force for `world` ranks: its mesh, how it reshards, its reduction dtype.
void resolve_options(ResolvedUnit& r, int world, at::ScalarType model_dtype) {
  const UnitPlan& unit = r.declared;
  try {
    r.mesh = resolve_mesh(unit.mesh, world);
  } catch (const UserError& e) {
    throw UserError(where(unit) + ": " + e.what());
  }
  // As FSDP2 reads it: k = 1 keeps everything gathered, k = shard frees everything.
  int k = unit.reshard_after_forward == kWholeShardGroup ? r.mesh.shard : unit.reshard_after_forward;
  // A one-rank shard group has nothing to keep a part of: any k frees everything there, so a
  // plan made for k ranks runs in a single process too.
  if (r.mesh.shard == 1 && k > 1) k = 1;
  if (k < 1 || r.mesh.shard % k != 0) {
    throw UserError(where(unit) + ": reshard_after_forward = " + std::to_string(k) +
                    " does not divide the unit's shard size " + std::to_string(r.mesh.shard));
  }
  // k = shard frees everything, as true does (false on a one-rank shard still keeps it all).
  r.reshard_after_forward = k == r.mesh.shard && unit.reshard_after_forward != 1 ? kWholeShardGroup : k;
  r.compute_dtype = unit.param_dtype.value_or(model_dtype);
  if (unit.compute == ProductPrecision::fp8 && r.compute_dtype != at::kBFloat16) {
    throw UserError(where(unit) + ": precision compute = \"fp8\" needs param = \"bfloat16\" (float8 products "
                    "take and give bf16), but the unit computes in " + dtype_name(r.compute_dtype));
  }
  r.reduce_dtype = unit.reduce_dtype.value_or(master_dtype(model_dtype));
  for (const auto& p : unit.modules) r.name += (r.name.empty() ? "" : "+") + module_label(p);
}

// The model's parameters, each with every path that reaches it (tied ones have several);
// units claim theirs innermost first, so a parameter belongs to the deepest unit covering it.
class ParameterClaims {
 public:
  ParameterClaims(Module& root, at::ScalarType model_dtype)
      : all_(named_modules(root)),
        master_bytes_(static_cast<int64_t>(c10::elementSize(master_dtype(model_dtype)))) {
    for (const auto& e : all_) {
      for (const auto& item : e.module->named_parameters(/*recurse=*/false)) {
        aliases_[item.value().unsafeGetTensorImpl()].push_back(e.path.empty() ? item.key() : e.path + "." + item.key());
      }
      if (e.module->routed_experts()) expert_paths_.push_back(e.path);
    }
  }

  const std::vector<ModuleEntry>& modules() const { return all_; }
  int64_t master_bytes() const { return master_bytes_; }

  // Gives `r` every unclaimed parameter under its modules, and adds their sizes to `r` and
  // to the plan's per-rank totals.
  void claim(ResolvedUnit& r, ResolvedPlan& resolved) {
    const auto& modules = r.declared.modules;
    auto covered = [&modules](const std::string& path) {
      return std::any_of(modules.begin(), modules.end(), [&](const auto& m) { return path_under(path, m); });
    };
    for (const auto& e : all_) {
      if (!covered(e.path)) continue;
      for (const auto& item : e.module->named_parameters(/*recurse=*/false)) {
        const void* impl = item.value().unsafeGetTensorImpl();
        if (!claimed_.insert(impl).second) continue;
        const auto& paths = aliases_[impl];
        const auto held = std::find_if(paths.begin(), paths.end(), covered);
        for (const auto& alias : paths) {
          if (!covered(alias)) {
            throw UserError(where(r.declared) + ": tied parameters " + *held + " and " + alias +
                            " must be in one unit, but unit " + r.name + " holds only the first");
          }
        }
        add(r, resolved, e, item.key(), item.value(), paths.front());
      }
    }
  }

 private:
  void add(ResolvedUnit& r, ResolvedPlan& resolved, const ModuleEntry& e, const std::string& local, const at::Tensor& t,
           const std::string& name) const {
    const auto compute_bytes = static_cast<int64_t>(c10::elementSize(r.compute_dtype));
    const bool constant =
        !t.requires_grad() && !e.module->updated_without_gradient(local) && compute_bytes < master_bytes_;
    r.params.push_back({name, e.module, local, constant});
    r.numel += t.numel();
    const int64_t per_rank = ShardShape(t.sizes(), r.mesh.shard).shard_numel();
    r.padded_numel_per_rank += per_rank;
    const int64_t bytes = per_rank * (constant ? compute_bytes : master_bytes_);
    resolved.param_bytes += bytes;
    if (constant) resolved.constant_param_bytes += bytes;
    if (r.declared.offload == Offload::cpu) resolved.host_param_bytes += bytes;
    if (t.requires_grad()) {
      r.trainable_numel_per_rank += per_rank;
      resolved.trainable_numel += t.numel();
    }
    const bool expert = std::any_of(expert_paths_.begin(), expert_paths_.end(),
                                    [&](const auto& p) { return path_under(e.path, p); });
    if (expert) {
      resolved.expert_param_bytes += bytes;
      r.expert_numel += t.numel();
      r.expert_numel_per_rank += per_rank;
      r.expert_bytes_per_rank += bytes;
    }
  }

  std::vector<ModuleEntry> all_;
  int64_t master_bytes_;
  std::map<const void*, std::vector<std::string>> aliases_;
  std::vector<std::string> expert_paths_;  // containers of routed experts
  std::set<const void*> claimed_;
};

}  // namespace

ResolvedPlan resolve_plan(const Plan& plan, Module& root, int world, at::ScalarType model_dtype) {
  ParameterClaims claims(root, model_dtype);
  std::map<std::string, Module*> by_path;
  for (const auto& e : claims.modules()) by_path[e.path] = e.module;
  std::vector<UnitPlan> units = units_with_root(plan, by_path);
  std::stable_sort(units.begin(), units.end(), [](const UnitPlan& a, const UnitPlan& b) { return depth(a) > depth(b); });

  ResolvedPlan resolved;
  for (auto& unit : units) {
    if (plan.lora && plan.lora->dropout > 0 && unit.activation_checkpoint) {
      throw UserError(concat(plan.lora->origin, ": lora dropout ", plan.lora->dropout,
                             " with activation_checkpoint on the unit declared at ", where(unit),
                             ": its recomputation would draw other dropout masks than its forward did"));
    }
    ResolvedUnit r{.declared = std::move(unit)};
    resolve_options(r, world, model_dtype);
    claims.claim(r, resolved);
    // Every parameter under its modules belongs to units inside it (a root left with none, a
    // block whose parts are each a unit): there is nothing for it to gather, as fully_shard
    // on such a module does nothing.
    if (r.numel == 0) {
      refuse_if_declares_more(r.declared);
      continue;
    }
    r.bytes_gathered = r.numel * static_cast<int64_t>(c10::elementSize(r.compute_dtype));
    r.expert_bytes_gathered = r.expert_numel * static_cast<int64_t>(c10::elementSize(r.compute_dtype));
    resolved.total_numel += r.numel;
    resolved.largest_gathered_bytes = std::max(resolved.largest_gathered_bytes, r.bytes_gathered);
    resolved.units.push_back(std::move(r));
  }
  int64_t trainable_per_rank = 0;
  for (const auto& u : resolved.units) trainable_per_rank += u.trainable_numel_per_rank;
  resolved.grad_bytes = trainable_per_rank * claims.master_bytes();
  resolved.optimizer_bytes = 2 * resolved.grad_bytes;
  resolved.lora = plan.lora;
  resolved.frozen = plan.frozen;
  resolved.options = plan.options;
  return resolved;
}

void freeze_modules(const Plan& plan, Module& root) {
  if (!plan.frozen) return;
  if (plan.lora) {
    throw UserError(concat(plan.frozen->origin, ": freeze beside lora (", plan.lora->origin, "): a LoRA run's base ",
                           "is frozen already, and lora's trainable names what of it trains"));
  }
  std::map<std::string, Module*> by_path;
  for (const auto& e : named_modules(root)) by_path[e.path] = e.module;
  const auto training = [&root] {
    const auto params = root.parameters();
    return std::any_of(params.begin(), params.end(), [](const at::Tensor& p) { return p.requires_grad(); });
  };
  const bool trained_before = training();
  for (const auto& path : plan.frozen->paths) {
    const auto found = by_path.find(path);
    if (found == by_path.end()) throw UserError(concat(plan.frozen->origin, ": freeze: no module at path '", path, "'"));
    for (auto& p : found->second->parameters()) p.set_requires_grad(false);
  }
  // A tied weight is one tensor under two names: freezing one name holds the other too, as it
  // does in transformers, and says so where the other's module was not named.
  const auto named = [&](const std::string& name) {
    const auto& paths = plan.frozen->paths;
    return std::any_of(paths.begin(), paths.end(), [&](const std::string& p) { return path_under(name, p); });
  };
  for (const auto& group : tied_parameter_groups(root)) {
    const auto frozen = std::find_if(group.begin(), group.end(), named);
    const auto held = std::find_if_not(group.begin(), group.end(), named);
    if (frozen != group.end() && held != group.end()) {
      log_info(plan.frozen->origin, ": freeze: ", *held, " is ", *frozen, " (tied), so it stays as loaded too");
    }
  }
  // A run whose weights all stay is a reference model, which says so where it is built.
  if (trained_before && !training()) {
    throw UserError(concat(plan.frozen->origin, ": freeze holds every parameter of the model, so nothing would train; "
                           "a model kept as loaded is a reference (fsdpp.Run(..., frozen=True) from Python)"));
  }
}

}  // namespace fsdpp
