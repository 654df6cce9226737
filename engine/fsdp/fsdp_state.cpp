// Building units from a plan and the end-of-backward bookkeeping shared by them.
#include "fsdp/fsdp_state.h"

#include <ATen/ATen.h>

#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
#include "models/fp8_product.h"
#include "models/layers.h"
#include "models/moe.h"

#include <algorithm>
#include <unordered_set>

namespace fsdpp {

ShardFill fresh_init_fill(Module& root, uint64_t seed, double std) {
  // Owners by path, built once rather than by a walk of the model per parameter.
  auto owners = std::make_shared<std::map<std::string, Module*>>();
  for (const auto& e : named_modules(root)) owners->emplace(e.path, e.module);
  return [owners, seed, std](const std::string& name, const at::Tensor& param, at::Tensor& rows, int64_t first_row) {
    if (rows.size(0) == 0) return;  // a trailing rank that owns no rows
    at::NoGradGuard no_grad;
    const auto dot = name.rfind('.');
    auto it = owners->find(dot == std::string::npos ? "" : name.substr(0, dot));
    TORCH_CHECK(it != owners->end(), "no module owns parameter ", name);
    Module* owner = it->second;
    // In the parameter's dtype, so the master holds exactly what a materialised model would;
    // the generator depends on the name alone, so every world size sees the same values.
    at::Tensor full = at::empty(param.sizes(), param.options());
    at::Generator gen = named_generator(seed, name);
    owner->init_parameter(dot == std::string::npos ? name : name.substr(dot + 1), full, gen, std);
    rows.view({rows.size(0), -1}).copy_(full.reshape({param.dim() == 0 ? 1 : param.size(0), -1}).narrow(0, first_row, rows.size(0)));
  };
}

namespace {

// A unit's shards: each parameter's `local` a slice of one of two flat buffers.
struct UnitShards {
  std::vector<ShardedParam> params;  // in gather order
  at::Tensor masters;                // [M] the leading params' shards, in the masters' dtype
  at::Tensor constants;              // [T - M] the constant params' shards, in the compute dtype
};

// The buffers are laid out in the order the unit's gathers read them, so a gather starts with
// one copy (and cast) of each. Parameters that train come first: a unit reduces gradients for
// that prefix alone, so a frozen base (LoRA) costs no gradient traffic or memory. Constant
// ones come last, with no master (a bf16 base holds 2 bytes per element, not 4).
UnitShards lay_out_shards(const ResolvedUnit& unit, int rank, int world, const ShardFill& fill,
                          const at::TensorOptions& buffer) {
  struct Placed {
    const ResolvedUnit::Param* param;
    at::Tensor tensor;
    int place;  // 0 trains, 1 frozen with a master, 2 constant
  };
  std::vector<Placed> placed;
  for (const auto& p : unit.params) {
    at::Tensor t = p.module->named_parameters(/*recurse=*/false)[p.local];
    placed.push_back({&p, t, t.requires_grad() ? 0 : p.constant ? 2 : 1});
  }
  std::stable_sort(placed.begin(), placed.end(), [](const Placed& a, const Placed& b) { return a.place < b.place; });
  std::vector<int64_t> offsets{0};  // where each parameter's shard starts, masters then constants
  size_t held = 0;                  // parameters with masters
  for (const auto& p : placed) {
    offsets.push_back(offsets.back() + ShardShape(p.tensor.sizes(), world).shard_numel());
    if (p.place < 2) ++held;
  }
  UnitShards out;
  out.masters = at::zeros({offsets[held]}, buffer.dtype(master_dtype(placed.front().tensor.scalar_type())));
  out.constants = at::zeros({offsets.back() - offsets[held]}, buffer.dtype(unit.compute_dtype));
  for (size_t i = 0; i < placed.size(); ++i) {
    const int64_t length = offsets[i + 1] - offsets[i];
    at::Tensor slot = i < held ? out.masters.narrow(0, offsets[i], length)
                               : out.constants.narrow(0, offsets[i] - offsets[held], length);
    out.params.emplace_back(placed[i].param->name, placed[i].tensor, rank, world, fill, slot);
  }
  return out;
}

// The modules whose Linear layers keep bf16 products under precision{compute = "fp8"}: a
// MoE layer's router, whose rounding in float8 would flip the experts tokens go to, and its
// routed experts, whose grouped product runs in bf16 (one expert at a time they stay alike).
std::unordered_set<const Module*> routing_modules(Module& root) {
  std::unordered_set<const Module*> out;
  for (const auto& e : named_modules(root)) {
    if (const auto* moe_block = dynamic_cast<MoeBlock*>(e.module)) out.insert(moe_block->routing_module());
    if (!e.module->routed_experts()) continue;
    for (const auto& inner : named_modules(*e.module)) out.insert(inner.module);
  }
  return out;
}

// precision{compute = "fp8"}: the unit's Linear layers whose weights fit the FP8 matrix units
// multiply in float8; adapters, routing modules and the rest stay in the gathered dtype.
// Refused, naming the unit, where the device has no such units.
void use_fp8_products(const ResolvedUnit& unit, const at::Device& device,
                      const std::unordered_set<const Module*>& keep_bf16) {
  if (!fp8_products_run(device)) {
    throw UserError(unit.declared.origin + ": unit " + unit.name + " declares precision compute = \"fp8\", which "
                    "needs a GPU with FP8 matrix units (compute capability 9.0 or newer); this run computes on " +
                    device.str());
  }
  for (const auto& p : unit.params) {
    auto* linear = dynamic_cast<Linear*>(p.module);
    if (linear != nullptr && p.local == "weight" && dynamic_cast<LoraFactor*>(linear) == nullptr &&
        !keep_bf16.contains(linear) && fp8_product_fits(linear->weight)) {
      linear->fp8_products = true;
    }
  }
}

}  // namespace

FsdpState::FsdpState(Module& root, std::shared_ptr<Comm> world, const ResolvedPlan& plan, const ShardFill& fill,
                     at::Device device)
    : world_(std::move(world)), device_(device), copy_stream_(device) {
  const auto all = named_modules(root);
  const auto keep_bf16 = routing_modules(root);
  for (const auto& unit : plan.units) {
    auto same = [&unit](const DeviceMesh& m) { return m.replicate == unit.mesh.replicate && m.shard == unit.mesh.shard; };
    auto found = std::find_if(meshes_.begin(), meshes_.end(), same);
    if (found == meshes_.end()) {
      meshes_.push_back(DeviceMesh::create(world_, unit.mesh));
      found = meshes_.end() - 1;
    }
    unit_mesh_.push_back(static_cast<size_t>(found - meshes_.begin()));
    const DeviceMesh& mesh = *found;
    if (unit.declared.compute == ProductPrecision::fp8) use_fp8_products(unit, device, keep_bf16);
    const bool offload = unit.declared.offload == Offload::cpu;
    offloaded_ = offloaded_ || (offload && !device.is_cpu());
    // Offloaded masters sit in page-locked memory when a device is in use, so copies to and
    // from it run without staging.
    const auto buffer = offload ? at::TensorOptions().device(at::kCPU).pinned_memory(!device.is_cpu())
                                : at::TensorOptions().device(device);
    UnitShards shards = lay_out_shards(unit, mesh.shard_group->rank(), mesh.shard_group->size(), fill, buffer);
    std::vector<Module*> modules;
    for (const auto& path : unit.declared.modules) {
      for (const auto& e : all) {
        if (e.path == path) modules.push_back(e.module);
      }
    }
    const UnitPlan& p = unit.declared;
    const int k = unit.reshard_after_forward;
    UnitOptions options{.reshard_after_forward = k != 1,
                        .post_forward_group = k > 1 ? post_forward_group(unit_mesh_.back(), k) : nullptr,
                        .activation_checkpoint = p.activation_checkpoint,
                        .param_dtype = p.param_dtype,
                        .reduce_dtype = unit.reduce_dtype,
                        .output_dtype = p.output_dtype,
                        .device = device,
                        .copy_stream = offload && !device.is_cpu() ? &copy_stream_ : nullptr};
    units_.push_back(std::make_unique<FsdpUnit>(unit.name, modules, std::move(shards.params), shards.masters,
                                                shards.constants, mesh.shard_group, mesh.replicate_group, options,
                                                this));
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

std::vector<ShardRows> FsdpState::shard_rows() const {
  std::vector<ShardRows> out;
  for (size_t u = 0; u < units_.size(); ++u) {
    const auto& replicas = meshes_[unit_mesh_[u]].replicate_group;
    for (const auto& p : units_[u]->params()) {
      out.push_back({p.name, p.owned, p.param.sizes().vec(), p.first_row, !replicas || replicas->rank() == 0});
    }
  }
  return out;
}

std::vector<std::string> FsdpState::mesh_shapes() const {
  std::vector<std::string> out;
  for (const auto& m : meshes_) out.push_back(std::to_string(m.replicate) + "x" + std::to_string(m.shard));
  return out;
}

std::shared_ptr<Comm> FsdpState::post_forward_group(size_t mesh, int k) {
  // One group per (mesh, k): every group needs rendezvous keys of its own.
  auto& group = post_forward_groups_[{mesh, k}];
  if (!group) group = meshes_[mesh].post_forward_group(k);
  return group;
}

std::vector<GradGroup> FsdpState::grad_groups() const {
  std::vector<GradGroup> groups(meshes_.size());
  for (size_t i = 0; i < meshes_.size(); ++i) groups[i].shard_group = meshes_[i].shard_group.get();
  for (size_t u = 0; u < units_.size(); ++u) {
    for (const auto& p : units_[u]->params()) {
      groups[unit_mesh_[u]].params.push_back(p.owned);
      groups[unit_mesh_[u]].grad_norms.push_back(p.known_grad_norm());
    }
  }
  return groups;
}

at::Tensor FsdpState::gradient_arrivals() const {
  std::vector<double> arrived;
  for (const auto& unit : units_) {
    for (const auto& p : unit->params()) {
      if (p.param.requires_grad()) arrived.push_back(p.gradient_arrived ? 1.0 : 0.0);
    }
  }
  return at::tensor(arrived, at::kDouble);
}

void FsdpState::drop_unarrived_gradients(const at::Tensor& arrivals) {
  const at::Tensor summed = arrivals.to(at::kCPU, at::kDouble).contiguous();
  const auto arrived = summed.accessor<double, 1>();
  int64_t i = 0;
  for (const auto& unit : units_) {
    for (auto& p : unit->params()) {
      if (p.param.requires_grad() && arrived[i++] == 0.0) p.owned.mutable_grad() = at::Tensor();
    }
  }
}

void FsdpState::forget_gradients() {
  for (const auto& unit : units_) {
    for (auto& p : unit->params()) p.gradient_arrived = false;
  }
}

void FsdpState::for_each_full_parameter(const std::function<void(const std::string&, const at::Tensor&)>& visit) {
  for (const auto& unit : units_) unit->for_each_full_value(visit);
}

void FsdpState::reshard_all() {
  for (auto& unit : units_) {
    unit->reshard();
    unit->release_cast_shard();
  }
  // An offloaded unit's copy-in reads its pinned masters when the copy stream reaches it,
  // which a forward with no backward after it (evaluation, sampling) leaves unawaited.
  if (offloaded_) copy_stream_.synchronize();
}

std::vector<FsdpUnit*> FsdpState::host_updated_units() const {
  std::vector<FsdpUnit*> order = forward_order_;
  for (const auto& unit : units_) {
    if (!forward_index_.contains(unit.get())) order.push_back(unit.get());
  }
  std::erase_if(order, [](FsdpUnit* unit) {
    const auto& params = unit->params();
    const bool trains =
        std::any_of(params.begin(), params.end(), [](const auto& p) { return p.param.requires_grad(); });
    return !trains || !unit->home().is_cpu();
  });
  return order;
}

std::vector<std::vector<at::Tensor>> FsdpState::host_update_batches() const {
  std::vector<std::vector<at::Tensor>> batches;
  for (FsdpUnit* unit : host_updated_units()) {
    auto& batch = batches.emplace_back();
    for (const auto& p : unit->params()) {
      if (p.param.requires_grad()) batch.push_back(p.owned);
    }
  }
  return batches;
}

void FsdpState::expect_host_updates(const std::vector<std::shared_future<void>>& updates) {
  const auto units = host_updated_units();
  TORCH_CHECK(updates.size() == units.size(), "expected ", units.size(), " host updates, got ", updates.size());
  for (size_t i = 0; i < units.size(); ++i) units[i]->expect_update(updates[i]);
}

FsdpUnit* FsdpState::neighbour_in_forward(FsdpUnit* unit, int step) const {
  if (recording_order_) return nullptr;
  auto it = forward_index_.find(unit);
  if (it == forward_index_.end()) return nullptr;
  const auto index = it->second + step;
  return index >= 0 && index < static_cast<std::ptrdiff_t>(forward_order_.size()) ? forward_order_[index] : nullptr;
}

void FsdpState::on_pre_forward(FsdpUnit* unit) {
  if (recording_order_) {
    // A unit seen twice means a second forward began without a backward between (evaluation).
    if (forward_index_.emplace(unit, forward_order_.size()).second) {
      forward_order_.push_back(unit);
    } else {
      recording_order_ = false;
    }
  }
  unit->begin_unshard();
  // A prefetch that would wait for the next unit's host update would hold up this unit's
  // compute behind it; the next unit gathers for itself instead.
  FsdpUnit* next = neighbour_in_forward(unit, +1);
  if (next && !next->update_pending()) next->begin_unshard();
}

void FsdpState::on_pre_backward(FsdpUnit* unit) {
  if (!backward_.inside()) {  // the first unit of a backward
    // A call another thread makes holds the units until it ends (begin_call).
    std::lock_guard<std::mutex> no_call(calls_);
    if (in_backward_) {
      // Waiting here for the other backward to end could hold the device thread it needs: a
      // moment's wait tells one that ended in an exception, its ticket freed late, from one
      // another thread runs.
      if (backward_.running_after(std::chrono::milliseconds(100))) {
        throw UserError("a backward through the units began while another thread's still runs; backwards through "
                        "one run go one at a time");
      }
      // One that ended in an exception, with no call into the run since to clear it; one that
      // ended well during the wait has cleared itself.
      if (in_backward_) abandon_backward();
    }
    // A graph of the backward itself would have to differentiate the reductions and the
    // units' buffers, which run outside autograd.
    if (at::GradMode::is_enabled()) {
      throw UserError("backward with create_graph=True through the sharded units is not supported (a gradient of "
                      "the logits alone, torch.autograd.grad(loss, logits, create_graph=True), is)");
    }
    if (backward_check_) backward_check_();
    in_backward_ = true;
    recording_order_ = false;
    backward_.begin([this] { final_callback(); });
  }
  unit->begin_unshard();
  if (FsdpUnit* next = neighbour_in_forward(unit, -1)) next->begin_unshard();
}

void FsdpState::on_reduce_issued(FsdpUnit* unit) {
  // Each reduction in flight moves one stage on: a plain one completes when the next
  // begins, an HSDP one a unit later (its all-reduce across replicas in between).
  std::erase_if(reducing_, [unit](FsdpUnit* u) { return u != unit && u->advance_reduce(); });
  if (std::find(reducing_.begin(), reducing_.end(), unit) == reducing_.end()) reducing_.push_back(unit);
}

void FsdpState::final_callback() {
  // Units whose inputs needed no gradient (the root, an embedding) never saw their
  // post-backward fire, and a unit used by several forwards may hold gradients that arrived
  // after its last one did; reduce them now, in the same order on every rank.
  for (auto it = units_.rbegin(); it != units_.rend(); ++it) {
    if ((*it)->awaits_reduction()) (*it)->post_backward();
  }
  end_backward();
}

void FsdpState::end_backward() {
  ++backwards_ended_;
  for (auto& unit : units_) {
    unit->finish_reduce();
    unit->end_backward();
  }
  reducing_.clear();
  // Offloaded gradients arrive in host memory on the copy stream, behind the reductions;
  // the optimizer reads them next. Without offload nothing here waits for the device.
  if (offloaded_) {
    copy_stream_.synchronize();
    for (auto& unit : units_) unit->add_host_gradients();
  }
  in_backward_ = false;
}

std::unique_lock<std::mutex> FsdpState::begin_call() {
  for (;;) {
    const bool outside = backward_.wait_until_over();
    std::unique_lock<std::mutex> call(calls_);
    // A backward that began between the wait and the lock is waited for in turn.
    if (!outside || backward_.inside() || !backward_.running_after(std::chrono::milliseconds(0))) return call;
  }
}

bool FsdpState::settle_backward() {
  if (!backward_.wait_until_over()) return false;  // a call from inside the backward: a recomputation
  if (!in_backward_) return false;
  abandon_backward();
  return true;
}

void FsdpState::abandon_backward() {
  log_warn("a backward through the units ended in an exception: the gradients of the units it had reduced stand, "
           "the others are dropped");
  for (auto& unit : units_) unit->drop_unreduced();
  end_backward();
}

}  // namespace fsdpp
