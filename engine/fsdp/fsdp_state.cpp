// Building units from a plan and the end-of-backward bookkeeping shared by them.
#include "fsdp/fsdp_state.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>

namespace fsdpp {

namespace {

at::ScalarType dtype_of(const std::string& name, at::ScalarType fallback) {
  if (name.empty()) return fallback;
  return name == "bfloat16" ? at::kBFloat16 : name == "float16" ? at::kHalf : at::kFloat;
}

}  // namespace

FsdpState::FsdpState(Module& root, DeviceMesh mesh, const ResolvedPlan& plan, std::optional<FreshInit> fresh_init)
    : mesh_(std::move(mesh)) {
  TORCH_CHECK(plan.shard == mesh_.shard && plan.replicate == mesh_.replicate, "plan mesh ", plan.replicate, "x",
              plan.shard, " differs from the process mesh ", mesh_.replicate, "x", mesh_.shard);
  const auto all = named_modules(root);
  for (const auto& unit : plan.units) {
    std::vector<ShardedParam> params;
    for (const auto& p : unit.params) {
      at::Tensor tensor = p.module->named_parameters(/*recurse=*/false)[p.local];
      std::function<void(at::Tensor&)> fill;
      if (fresh_init) {
        // The same generator init_parameters would use: values depend on the name alone.
        fill = [&p, fresh_init](at::Tensor& full) {
          at::NoGradGuard no_grad;
          at::Generator gen = named_generator(fresh_init->seed, p.name);
          p.module->init_parameter(p.local, full, gen, fresh_init->std);
        };
      }
      params.emplace_back(p.name, tensor, mesh_.shard_group->rank(), mesh_.shard_group->size(), fill);
    }
    std::vector<Module*> modules;
    for (const auto& path : unit.plan->modules) {
      for (const auto& e : all) {
        if (e.path == path) modules.push_back(e.module);
      }
    }
    const UnitPlan& p = *unit.plan;
    UnitOptions options{.reshard_after_forward = p.reshard_after_forward,
                        .activation_checkpoint = p.activation_checkpoint,
                        .reduce_dtype = dtype_of(p.reduce_dtype, at::kFloat),
                        .output_dtype = p.output_dtype.empty() ? std::nullopt
                                                               : std::optional(dtype_of(p.output_dtype, at::kFloat))};
    units_.push_back(std::make_unique<FsdpUnit>(unit.name, modules, std::move(params), mesh_.shard_group,
                                                mesh_.replicate_group, options, this));
  }
}

FsdpState::~FsdpState() = default;

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

}  // namespace fsdpp
