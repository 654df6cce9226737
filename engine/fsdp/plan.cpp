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

bool under(const std::string& path, const std::string& prefix) {
  return prefix.empty() || path == prefix || path.starts_with(prefix + ".");
}

int depth(const UnitPlan& unit) {
  int d = 1 << 20;
  for (const auto& path : unit.modules) {
    d = std::min(d, path.empty() ? -1 : static_cast<int>(std::count(path.begin(), path.end(), '.')));
  }
  return d;
}

std::string where(const UnitPlan& unit) { return unit.origin.empty() ? "plan" : unit.origin; }

void check_dtype(const UnitPlan& unit, const std::string& key, const std::string& value, bool allow_empty) {
  if (allow_empty && value.empty()) return;
  try {
    parse_dtype(value);
  } catch (const UserError& e) {
    throw UserError(where(unit) + ": " + key + ": " + e.what());
  }
}

std::string mib(int64_t bytes) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(bytes < (1 << 20) ? 3 : 1) << static_cast<double>(bytes) / (1 << 20) << " MiB";
  return out.str();
}

}  // namespace

ResolvedPlan resolve_plan(Plan& plan, Module& root, int world, at::ScalarType model_dtype) {
  const auto all = named_modules(root);
  std::map<std::string, Module*> by_path;
  for (const auto& e : all) by_path[e.path] = e.module;

  const bool has_root = std::any_of(plan.units.begin(), plan.units.end(), [](const UnitPlan& u) {
    return std::find(u.modules.begin(), u.modules.end(), "") != u.modules.end();
  });
  if (plan.units.empty()) throw UserError("policy wrapped nothing: no module matched any of its rules");
  if (!has_root) {
    // The root's leftovers (final norm, lm_head) are used last in forward and first in
    // backward: keeping them gathered saves an all-gather per step.
    plan.units.push_back({.modules = {""}, .reshard_after_forward = false, .mesh = plan.units.front().mesh,
                          .origin = "root (implicit)"});
  }

  std::map<std::string, std::string> wrapped;  // module path -> unit origin
  for (auto& unit : plan.units) {
    if (unit.modules.empty()) throw UserError(where(unit) + ": wrap of an empty module list");
    for (const auto& path : unit.modules) {
      if (!by_path.count(path)) throw UserError(where(unit) + ": no module at path '" + path + "'");
      auto [it, fresh] = wrapped.emplace(path, where(unit));
      if (!fresh) {
        throw UserError(where(unit) + ": module '" + (path.empty() ? "<root>" : path) +
                        "' is already wrapped by " + it->second);
      }
    }
    check_dtype(unit, "precision.param", unit.param_dtype, true);
    if (unit.reduce_dtype.empty()) unit.reduce_dtype = dtype_name(master_dtype(model_dtype));
    check_dtype(unit, "precision.reduce", unit.reduce_dtype, false);
    check_dtype(unit, "precision.output", unit.output_dtype, true);
    if (unit.offload != "none" && unit.offload != "cpu") {
      throw UserError(where(unit) + ": offload '" + unit.offload + "' is not one of none, cpu");
    }
  }

  ResolvedPlan resolved;

  std::map<const void*, std::vector<std::string>> aliases;
  for (const auto& e : all) {
    for (const auto& item : e.module->named_parameters(/*recurse=*/false)) {
      aliases[item.value().unsafeGetTensorImpl()].push_back(e.path.empty() ? item.key() : e.path + "." + item.key());
    }
  }
  std::vector<UnitPlan*> order;
  for (auto& unit : plan.units) order.push_back(&unit);
  std::stable_sort(order.begin(), order.end(), [](auto* a, auto* b) { return depth(*a) > depth(*b); });

  std::set<const void*> claimed;
  for (UnitPlan* unit : order) {
    ResolvedUnit r;
    r.plan = unit;
    const MeshShape& mesh = unit->mesh;
    r.replicate = mesh.replicate;
    r.shard = mesh.shard == -1 ? (mesh.replicate > 0 ? world / mesh.replicate : 0) : mesh.shard;
    if (mesh.replicate < 1 || r.shard < 1 || mesh.replicate * r.shard != world) {
      throw UserError(where(*unit) + ": mesh replicate " + std::to_string(mesh.replicate) + " × shard " +
                      std::to_string(r.shard) + " ≠ world " + std::to_string(world));
    }
    if (unit->reshard_to != 0) {
      // As FSDP2 reads it: k = 1 keeps everything gathered, k = shard frees everything.
      const int k = unit->reshard_to;
      if (k < 1 || r.shard % k != 0) {
        throw UserError(where(*unit) + ": reshard_after_forward = " + std::to_string(k) +
                        " does not divide the unit's shard size " + std::to_string(r.shard));
      }
      unit->reshard_after_forward = k != 1;
      if (k == 1 || k == r.shard) unit->reshard_to = 0;
    }
    for (const auto& p : unit->modules) r.name += (r.name.empty() ? "" : "+") + (p.empty() ? std::string("<root>") : p);
    auto covered = [unit](const std::string& path) {
      return std::any_of(unit->modules.begin(), unit->modules.end(), [&](const auto& m) { return under(path, m); });
    };
    for (const auto& e : all) {
      if (!covered(e.path)) continue;
      for (const auto& item : e.module->named_parameters(/*recurse=*/false)) {
        const void* impl = item.value().unsafeGetTensorImpl();
        if (!claimed.insert(impl).second) continue;
        const auto& paths = aliases[impl];
        for (const auto& alias : paths) {
          if (!covered(alias)) {
            throw UserError(where(*unit) + ": tied parameters " + paths.front() + " and " + alias +
                            " must be in one unit, but unit " + r.name + " holds only the first");
          }
        }
        const at::Tensor& t = item.value();
        r.params.push_back({paths.front(), e.module, item.key()});
        r.numel += t.numel();
        r.padded_numel_per_rank += ShardShape(t.sizes(), r.shard).shard_numel();
      }
    }
    r.bytes_gathered = r.numel * static_cast<int64_t>(c10::elementSize(
        unit->param_dtype.empty() ? model_dtype : parse_dtype(unit->param_dtype)));
    resolved.total_numel += r.numel;
    resolved.param_bytes += r.padded_numel_per_rank * 4;
    resolved.largest_gathered_bytes = std::max(resolved.largest_gathered_bytes, r.bytes_gathered);
    resolved.units.push_back(std::move(r));
  }
  resolved.grad_bytes = resolved.param_bytes;
  resolved.optimizer_bytes = 2 * resolved.param_bytes;
  return resolved;
}

std::string format_plan(const ResolvedPlan& plan, int world) {
  std::ostringstream out;
  out << "plan for " << world << " rank(s): " << plan.units.size() << " units, " << plan.total_numel
      << " parameters\n";
  for (const auto& u : plan.units) {
    const UnitPlan& p = *u.plan;
    out << "  unit " << u.name << "  (" << p.origin << ")\n"
        << "    params " << u.numel << " in " << u.params.size() << " tensors, per rank " << u.padded_numel_per_rank
        << ", gathered " << mib(u.bytes_gathered) << ", mesh replicate " << u.replicate << " × shard " << u.shard
        << "\n"
        << "    reshard_after_forward "
        << (p.reshard_to ? std::to_string(p.reshard_to) : p.reshard_after_forward ? "true" : "false") << ", precision param "
        << (p.param_dtype.empty() ? "model" : p.param_dtype) << " reduce " << p.reduce_dtype << " output "
        << (p.output_dtype.empty() ? "as computed" : p.output_dtype) << ", offload " << p.offload
        << ", activation_checkpoint " << (p.activation_checkpoint ? "true" : "false") << "\n";
  }
  out << "per rank: parameters " << mib(plan.param_bytes) << ", gradients " << mib(plan.grad_bytes)
      << ", optimizer state " << mib(plan.optimizer_bytes) << ", largest gathered unit "
      << mib(plan.largest_gathered_bytes) << "\n";
  return out.str();
}

NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(MeshShape, replicate, shard)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(UnitPlan, modules, reshard_after_forward, reshard_to, param_dtype, reduce_dtype,
                                   output_dtype, offload, activation_checkpoint, mesh, origin)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(Plan, units, warnings)

std::string serialize_plan(const Plan& plan) { return nlohmann::json(plan).dump(); }

Plan deserialize_plan(const std::string& text) { return nlohmann::json::parse(text).get<Plan>(); }

std::string plan_json(const ResolvedPlan& plan, int world) {
  nlohmann::json units = nlohmann::json::array();
  for (const auto& u : plan.units) {
    const UnitPlan& p = *u.plan;
    nlohmann::json params = nlohmann::json::array();
    for (const auto& param : u.params) params.push_back(param.name);
    units.push_back({{"name", u.name}, {"modules", p.modules}, {"origin", p.origin}, {"params", params},
                     {"mesh", {{"replicate", u.replicate}, {"shard", u.shard}}},
                     {"numel", u.numel}, {"numel_per_rank", u.padded_numel_per_rank},
                     {"bytes_gathered", u.bytes_gathered}, {"reshard_after_forward", p.reshard_to ? nlohmann::json(p.reshard_to) : nlohmann::json(p.reshard_after_forward)},
                     {"precision", {{"param", p.param_dtype}, {"reduce", p.reduce_dtype}, {"output", p.output_dtype}}},
                     {"offload", p.offload}, {"activation_checkpoint", p.activation_checkpoint}});
  }
  return nlohmann::json{{"world", world}, {"total_numel", plan.total_numel}, {"units", units},
                        {"per_rank_bytes", {{"params", plan.param_bytes}, {"grads", plan.grad_bytes},
                                            {"optimizer", plan.optimizer_bytes},
                                            {"largest_gathered_unit", plan.largest_gathered_bytes}}}}
      .dump(2);
}

}  // namespace fsdpp
