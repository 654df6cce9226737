// Resolving and printing wrap plans.
#include "fsdp/plan.h"

#include "core/dtype.h"
#include "core/error.h"
#include "core/module_tree.h"
#include "fsdp/sharded_param.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>

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

std::string mib(int64_t bytes) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(bytes < (1 << 20) ? 3 : 1) << static_cast<double>(bytes) / (1 << 20) << " MiB";
  return out.str();
}

// The plan's units with the root added when the plan lacks one, each checked for paths that
// exist and modules wrapped once.
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
      auto [it, fresh] = wrapped.emplace(path, where(unit));
      if (!fresh) {
        throw UserError(where(unit) + ": module '" + (path.empty() ? "<root>" : path) +
                        "' is already wrapped by " + it->second);
      }
    }
  }
  return units;
}

// The unit's options in force for `world` ranks: its mesh, how it reshards, its reduction dtype.
void resolve_options(ResolvedUnit& r, int world, at::ScalarType model_dtype) {
  const UnitPlan& unit = r.declared;
  try {
    r.mesh = resolve_mesh(unit.mesh, world);
  } catch (const UserError& e) {
    throw UserError(where(unit) + ": " + e.what());
  }
  // As FSDP2 reads it: k = 1 keeps everything gathered, k = shard frees everything.
  const int k = unit.reshard_after_forward == kWholeShardGroup ? r.mesh.shard : unit.reshard_after_forward;
  if (k < 1 || r.mesh.shard % k != 0) {
    throw UserError(where(unit) + ": reshard_after_forward = " + std::to_string(k) +
                    " does not divide the unit's shard size " + std::to_string(r.mesh.shard));
  }
  // k = shard frees everything, as true does (false on a one-rank shard still keeps it all).
  r.reshard_after_forward = k == r.mesh.shard && unit.reshard_after_forward != 1 ? kWholeShardGroup : k;
  r.compute_dtype = unit.param_dtype.value_or(model_dtype);
  r.reduce_dtype = unit.reduce_dtype.value_or(master_dtype(model_dtype));
  for (const auto& p : unit.modules) r.name += (r.name.empty() ? "" : "+") + (p.empty() ? std::string("<root>") : p);
}

}  // namespace

ResolvedPlan resolve_plan(const Plan& plan, Module& root, int world, at::ScalarType model_dtype) {
  const auto all = named_modules(root);
  std::map<std::string, Module*> by_path;
  for (const auto& e : all) by_path[e.path] = e.module;
  std::vector<UnitPlan> units = units_with_root(plan, by_path);

  std::map<const void*, std::vector<std::string>> aliases;
  for (const auto& e : all) {
    for (const auto& item : e.module->named_parameters(/*recurse=*/false)) {
      aliases[item.value().unsafeGetTensorImpl()].push_back(e.path.empty() ? item.key() : e.path + "." + item.key());
    }
  }
  std::stable_sort(units.begin(), units.end(), [](const UnitPlan& a, const UnitPlan& b) { return depth(a) > depth(b); });
  std::vector<std::string> expert_paths;  // containers of routed experts
  for (const auto& e : all) {
    if (e.module->routed_experts()) expert_paths.push_back(e.path);
  }
  auto in_experts = [&expert_paths](const std::string& path) {
    return std::any_of(expert_paths.begin(), expert_paths.end(), [&](const auto& p) { return path_under(path, p); });
  };

  const auto master_bytes = static_cast<int64_t>(c10::elementSize(master_dtype(model_dtype)));
  ResolvedPlan resolved;
  std::set<const void*> claimed;
  for (auto& unit : units) {
    if (plan.lora && plan.lora->dropout > 0 && unit.activation_checkpoint) {
      throw UserError(plan.lora->origin + ": lora dropout " + std::to_string(plan.lora->dropout) +
                      " with activation_checkpoint on the unit declared at " + where(unit) +
                      ": its recomputation would draw other dropout masks than its forward did");
    }
    ResolvedUnit r{.declared = std::move(unit)};
    resolve_options(r, world, model_dtype);
    const auto& modules = r.declared.modules;
    auto covered = [&modules](const std::string& path) {
      return std::any_of(modules.begin(), modules.end(), [&](const auto& m) { return path_under(path, m); });
    };
    for (const auto& e : all) {
      if (!covered(e.path)) continue;
      for (const auto& item : e.module->named_parameters(/*recurse=*/false)) {
        const void* impl = item.value().unsafeGetTensorImpl();
        if (!claimed.insert(impl).second) continue;
        const auto& paths = aliases[impl];
        for (const auto& alias : paths) {
          if (!covered(alias)) {
            throw UserError(where(r.declared) + ": tied parameters " + paths.front() + " and " + alias +
                            " must be in one unit, but unit " + r.name + " holds only the first");
          }
        }
        const at::Tensor& t = item.value();
        const auto compute_bytes = static_cast<int64_t>(c10::elementSize(r.compute_dtype));
        const bool constant = !t.requires_grad() && !e.module->updated_without_gradient(item.key()) &&
                              compute_bytes < master_bytes;
        r.params.push_back({paths.front(), e.module, item.key(), constant});
        r.numel += t.numel();
        const int64_t per_rank = ShardShape(t.sizes(), r.mesh.shard).shard_numel();
        r.padded_numel_per_rank += per_rank;
        const int64_t bytes = per_rank * (constant ? compute_bytes : master_bytes);
        resolved.param_bytes += bytes;
        if (constant) resolved.constant_param_bytes += bytes;
        if (in_experts(e.path)) resolved.expert_param_bytes += bytes;
        if (t.requires_grad()) {
          r.trainable_numel_per_rank += per_rank;
          resolved.trainable_numel += t.numel();
        }
        if (in_experts(e.path)) {
          r.expert_numel += t.numel();
          r.expert_numel_per_rank += per_rank;
        }
      }
    }
    r.bytes_gathered = r.numel * static_cast<int64_t>(c10::elementSize(r.compute_dtype));
    resolved.total_numel += r.numel;
    resolved.largest_gathered_bytes = std::max(resolved.largest_gathered_bytes, r.bytes_gathered);
    resolved.units.push_back(std::move(r));
  }
  int64_t trainable_per_rank = 0;
  for (const auto& u : resolved.units) trainable_per_rank += u.trainable_numel_per_rank;
  resolved.grad_bytes = trainable_per_rank * master_bytes;
  resolved.optimizer_bytes = 2 * resolved.grad_bytes;
  resolved.lora = plan.lora;
  return resolved;
}

namespace {

// How the plan shows a resolved reshard_after_forward: as FSDP2 spells it.
nlohmann::json reshard_value(const ResolvedUnit& u) {
  if (u.reshard_after_forward == kWholeShardGroup) return true;
  if (u.reshard_after_forward == 1) return false;
  return u.reshard_after_forward;
}

std::string dtype_or(const std::optional<at::ScalarType>& dtype, const std::string& otherwise) {
  return dtype ? dtype_name(*dtype) : otherwise;
}

const char* offload_name(Offload offload) { return offload == Offload::cpu ? "cpu" : "none"; }

}  // namespace

std::string format_plan(const ResolvedPlan& plan, int world) {
  std::ostringstream out;
  out << "plan for " << world << " rank(s): " << plan.units.size() << " units, " << plan.total_numel
      << " parameters\n";
  for (const auto& u : plan.units) {
    const UnitPlan& p = u.declared;
    out << "  unit " << u.name << "  (" << p.origin << ")\n"
        << "    params " << u.numel << " in " << u.params.size() << " tensors, per rank " << u.padded_numel_per_rank
        << ", gathered " << mib(u.bytes_gathered) << ", mesh replicate " << u.mesh.replicate << " × shard "
        << u.mesh.shard << "\n";
    if (u.expert_numel > 0) {
      out << "    routed experts: params " << u.expert_numel << ", per rank " << u.expert_numel_per_rank << "\n";
    }
    out
        << "    reshard_after_forward " << reshard_value(u).dump() << ", precision param "
        << dtype_or(p.param_dtype, "model") << " reduce " << dtype_name(u.reduce_dtype) << " output "
        << dtype_or(p.output_dtype, "as computed") << ", offload " << offload_name(p.offload)
        << ", activation_checkpoint " << (p.activation_checkpoint ? "true" : "false") << "\n";
  }
  if (const auto& lora = plan.lora) {
    out << "lora: rank " << lora->rank << ", alpha " << lora->alpha << ", dropout " << lora->dropout << " on "
        << lora->targets.size() << " modules  (" << lora->origin << "); " << lora->trainable.size()
        << " base modules trainable; " << plan.trainable_numel << " of " << plan.total_numel
        << " parameters train, the rest frozen\n";
  }
  out << "per rank: parameters " << mib(plan.param_bytes) << ", gradients " << mib(plan.grad_bytes)
      << ", optimizer state " << mib(plan.optimizer_bytes) << ", largest gathered unit "
      << mib(plan.largest_gathered_bytes) << "\n";
  if (plan.constant_param_bytes > 0) {
    out << "per rank, frozen parameters held in their compute dtype with no master: " << mib(plan.constant_param_bytes)
        << " of " << mib(plan.param_bytes) << "\n";
  }
  if (plan.expert_param_bytes > 0) {
    out << "per rank, routed experts: parameters " << mib(plan.expert_param_bytes) << " of "
        << mib(plan.param_bytes) << " (gradients and optimizer state in proportion)\n";
  }
  return out.str();
}

// Declared plans cross processes as JSON; dtypes by their names.
void to_json(nlohmann::json& j, const UnitPlan& u) {
  auto dtype = [](const std::optional<at::ScalarType>& d) { return d ? nlohmann::json(dtype_name(*d)) : nlohmann::json(); };
  j = {{"modules", u.modules}, {"reshard_after_forward", u.reshard_after_forward},
       {"param_dtype", dtype(u.param_dtype)}, {"reduce_dtype", dtype(u.reduce_dtype)},
       {"output_dtype", dtype(u.output_dtype)}, {"offload", u.offload == Offload::cpu},
       {"activation_checkpoint", u.activation_checkpoint},
       {"mesh", {u.mesh.replicate, u.mesh.shard}}, {"origin", u.origin}};
}

void from_json(const nlohmann::json& j, UnitPlan& u) {
  auto dtype = [&j](const char* key) {
    return j.at(key).is_null() ? std::nullopt : std::optional(parse_dtype(j.at(key).get<std::string>()));
  };
  u = {.modules = j.at("modules").get<std::vector<std::string>>(),
       .reshard_after_forward = j.at("reshard_after_forward").get<int>(),
       .param_dtype = dtype("param_dtype"), .reduce_dtype = dtype("reduce_dtype"), .output_dtype = dtype("output_dtype"),
       .offload = j.at("offload").get<bool>() ? Offload::cpu : Offload::none,
       .activation_checkpoint = j.at("activation_checkpoint").get<bool>(),
       .mesh = {j.at("mesh").at(0).get<int>(), j.at("mesh").at(1).get<int>()},
       .origin = j.at("origin").get<std::string>()};
}

NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(LoraPlan, targets, rank, alpha, dropout, trainable, origin)

void to_json(nlohmann::json& j, const Plan& plan) {
  j = {{"units", plan.units}, {"warnings", plan.warnings},
       {"lora", plan.lora ? nlohmann::json(*plan.lora) : nlohmann::json()}};
}

void from_json(const nlohmann::json& j, Plan& plan) {
  plan.units = j.at("units").get<std::vector<UnitPlan>>();
  plan.warnings = j.at("warnings").get<std::vector<std::string>>();
  if (!j.at("lora").is_null()) plan.lora = j.at("lora").get<LoraPlan>();
}

std::string serialize_plan(const Plan& plan) { return nlohmann::json(plan).dump(); }

Plan deserialize_plan(const std::string& text) { return nlohmann::json::parse(text).get<Plan>(); }

std::string serialize_lora(const LoraPlan& lora) { return nlohmann::json(lora).dump(); }

LoraPlan deserialize_lora(const std::string& text) { return nlohmann::json::parse(text).get<LoraPlan>(); }

std::string plan_json(const ResolvedPlan& plan, int world) {
  nlohmann::json units = nlohmann::json::array();
  for (const auto& u : plan.units) {
    const UnitPlan& p = u.declared;
    nlohmann::json params = nlohmann::json::array();
    for (const auto& param : u.params) params.push_back(param.name);
    units.push_back({{"name", u.name}, {"modules", p.modules}, {"origin", p.origin}, {"params", params},
                     {"mesh", {{"replicate", u.mesh.replicate}, {"shard", u.mesh.shard}}},
                     {"numel", u.numel}, {"numel_per_rank", u.padded_numel_per_rank},
                     {"bytes_gathered", u.bytes_gathered}, {"reshard_after_forward", reshard_value(u)},
                     {"expert_numel", u.expert_numel}, {"expert_numel_per_rank", u.expert_numel_per_rank},
                     {"precision", {{"param", dtype_or(p.param_dtype, "")}, {"reduce", dtype_name(u.reduce_dtype)},
                                    {"output", dtype_or(p.output_dtype, "")}}},
                     {"offload", offload_name(p.offload)}, {"activation_checkpoint", p.activation_checkpoint}});
  }
  return nlohmann::json{{"world", world}, {"total_numel", plan.total_numel}, {"trainable_numel", plan.trainable_numel},
                        {"lora", plan.lora ? nlohmann::json(*plan.lora) : nlohmann::json()}, {"units", units},
                        {"per_rank_bytes", {{"params", plan.param_bytes}, {"grads", plan.grad_bytes},
                                            {"optimizer", plan.optimizer_bytes},
                                            {"largest_gathered_unit", plan.largest_gathered_bytes},
                                            {"expert_params", plan.expert_param_bytes},
                                            {"constant_params", plan.constant_param_bytes}}}}
      .dump(2);
}

}  // namespace fsdpp
