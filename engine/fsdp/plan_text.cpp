// Printing resolved plans, and declared plans to JSON text and back.
#include "fsdp/plan_text.h"

#include "core/dtype.h"
#include "core/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <iomanip>
#include <sstream>

namespace fsdpp {

namespace {

std::string mib(int64_t bytes) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(bytes < (1 << 20) ? 3 : 1) << static_cast<double>(bytes) / (1 << 20) << " MiB";
  return out.str();
}

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

// As precision{compute = ...} spells it; "param" where it was left out.
const char* compute_name(ProductPrecision compute) { return compute == ProductPrecision::fp8 ? "fp8" : "param"; }

// The declared options, one a line: those [policy.options] set marked, values aligned.
void format_options(std::ostream& out, const std::vector<PolicyOption>& options) {
  if (options.empty()) return;
  // Aligned up to a width most settings fit; a long string value just pushes its line on.
  size_t width = 0;
  for (const auto& o : options) width = std::max(width, o.name.size() + 3 + std::max<size_t>(o.value.size(), 5));
  width = std::min<size_t>(width, 40);
  out << "options (* set by [policy.options]):\n";
  for (const auto& o : options) {
    // A policy's text, written out as one line each: a doc holding line breaks would forge plan lines.
    const std::string setting = message_line(o.name + " = " + (o.value.empty() ? "unset" : o.value));
    out << (o.given ? "  * " : "    ") << std::left << std::setw(static_cast<int>(width)) << setting << "  "
        << message_line(o.accepts + (o.doc.empty() ? "" : "; " + o.doc)) << "\n";
  }
}

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
      out << "    routed experts: params " << u.expert_numel << ", per rank " << u.expert_numel_per_rank << " ("
          << mib(u.expert_bytes_per_rank) << "), gathered " << mib(u.expert_bytes_gathered) << "\n";
    }
    out
        << "    reshard_after_forward " << reshard_value(u).dump() << ", precision param "
        << dtype_or(p.param_dtype, "model") << " reduce " << dtype_name(u.reduce_dtype) << " output "
        << dtype_or(p.output_dtype, "as computed") << (p.compute == ProductPrecision::fp8 ? ", compute fp8" : "")
        << ", offload " << offload_name(p.offload)
        << ", activation_checkpoint " << (p.activation_checkpoint ? "true" : "false") << "\n";
  }
  if (const auto& lora = plan.lora) {
    out << "lora: rank " << lora->rank << ", alpha " << lora->alpha << ", dropout " << lora->dropout << " on "
        << lora->targets.size() << " modules  (" << lora->origin << "); " << lora->trainable.size()
        << " base modules trainable; " << plan.trainable_numel << " of " << plan.total_numel
        << " parameters train, the rest frozen\n";
  }
  if (const auto& frozen = plan.frozen) {
    out << "frozen: " << frozen->paths.size() << " modules  (" << frozen->origin << "); " << plan.trainable_numel
        << " of " << plan.total_numel << " parameters train\n";
  }
  format_options(out, plan.options);
  out << "per rank: parameters " << mib(plan.param_bytes) << ", gradients " << mib(plan.grad_bytes)
      << ", optimizer state " << mib(plan.optimizer_bytes) << ", largest gathered unit "
      << mib(plan.largest_gathered_bytes) << "\n";
  if (plan.constant_param_bytes > 0) {
    out << "per rank, frozen parameters held in their compute dtype with no master: " << mib(plan.constant_param_bytes)
        << " of " << mib(plan.param_bytes) << "\n";
  }
  if (plan.host_param_bytes > 0) {
    out << "per rank, in host memory (offload cpu): parameters " << mib(plan.host_param_bytes) << " of "
        << mib(plan.param_bytes) << " (gradients and optimizer state in proportion)\n";
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
       {"output_dtype", dtype(u.output_dtype)}, {"compute", compute_name(u.compute)},
       {"offload", u.offload == Offload::cpu},
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
       .compute = j.at("compute").get<std::string>() == "fp8" ? ProductPrecision::fp8 : ProductPrecision::param,
       .offload = j.at("offload").get<bool>() ? Offload::cpu : Offload::none,
       .activation_checkpoint = j.at("activation_checkpoint").get<bool>(),
       .mesh = {j.at("mesh").at(0).get<int>(), j.at("mesh").at(1).get<int>()},
       .origin = j.at("origin").get<std::string>()};
}

void to_json(nlohmann::json& j, const PolicyOption& o) {
  j = {{"name", o.name}, {"accepts", o.accepts}, {"value", o.value}, {"given", o.given}, {"doc", o.doc},
       {"origin", o.origin}};
}

void from_json(const nlohmann::json& j, PolicyOption& o) {
  o = {.name = j.at("name").get<std::string>(), .accepts = j.at("accepts").get<std::string>(),
       .value = j.at("value").get<std::string>(), .given = j.at("given").get<bool>(),
       .doc = j.at("doc").get<std::string>(), .origin = j.at("origin").get<std::string>()};
}

namespace {
nlohmann::json frozen_json(const std::optional<FrozenModules>& frozen) {
  return frozen ? nlohmann::json{{"paths", frozen->paths}, {"origin", frozen->origin}} : nlohmann::json();
}
}  // namespace

void to_json(nlohmann::json& j, const Plan& plan) {
  j = {{"units", plan.units}, {"options", plan.options}, {"warnings", plan.warnings},
       {"lora", plan.lora ? nlohmann::json(*plan.lora) : nlohmann::json()}, {"frozen", frozen_json(plan.frozen)}};
}

void from_json(const nlohmann::json& j, Plan& plan) {
  plan.units = j.at("units").get<std::vector<UnitPlan>>();
  plan.options = j.at("options").get<std::vector<PolicyOption>>();
  plan.warnings = j.at("warnings").get<std::vector<std::string>>();
  if (!j.at("lora").is_null()) plan.lora = j.at("lora").get<LoraPlan>();
  if (const auto& frozen = j.at("frozen"); !frozen.is_null()) {
    plan.frozen = FrozenModules{.paths = frozen.at("paths").get<std::vector<std::string>>(),
                                .origin = frozen.at("origin").get<std::string>()};
  }
}

// A policy's strings (names, warnings, option docs) need not be UTF-8, which JSON text must be:
// bytes that are not become U+FFFD, where a strict dump would refuse the whole plan.
std::string serialize_plan(const Plan& plan) {
  return nlohmann::json(plan).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

Plan deserialize_plan(const std::string& text) { return nlohmann::json::parse(text).get<Plan>(); }

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
                     {"expert_bytes_per_rank", u.expert_bytes_per_rank}, {"expert_bytes_gathered", u.expert_bytes_gathered},
                     {"precision", {{"param", dtype_or(p.param_dtype, "")}, {"reduce", dtype_name(u.reduce_dtype)},
                                    {"output", dtype_or(p.output_dtype, "")}, {"compute", compute_name(p.compute)}}},
                     {"offload", offload_name(p.offload)}, {"activation_checkpoint", p.activation_checkpoint}});
  }
  return nlohmann::json{{"world", world}, {"total_numel", plan.total_numel}, {"trainable_numel", plan.trainable_numel},
                        {"lora", plan.lora ? nlohmann::json(*plan.lora) : nlohmann::json()},
                        {"frozen", frozen_json(plan.frozen)}, {"options", plan.options}, {"units", units},
                        {"per_rank_bytes", {{"params", plan.param_bytes}, {"grads", plan.grad_bytes},
                                            {"optimizer", plan.optimizer_bytes},
                                            {"largest_gathered_unit", plan.largest_gathered_bytes},
                                            {"expert_params", plan.expert_param_bytes},
                                            {"constant_params", plan.constant_param_bytes},
                                            {"host_params", plan.host_param_bytes}}}}
      .dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace fsdpp
