// Gathering one unit, and the forward/backward hooks that drive it (its gradients' reduction:
// fsdp/unit_reduce.cpp): pre-forward gathers and routes the inputs through an identity
// autograd function whose backward is the unit's post-backward; post-forward reshards and
// hooks the output, whose gradient arriving means this unit's backward is next
// (pre-backward: gather again).
#include "fsdp/unit.h"

#include "core/device.h"
#include "core/error.h"
#include "fsdp/fsdp_state.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <torch/csrc/autograd/custom_function.h>

namespace fsdpp {

namespace {

// Identity on the unit's inputs; its backward runs once the gradients of all the unit's
// inputs are ready, i.e. after the unit's whole backward, so every gradient of its
// parameters has been accumulated.
struct PostBackward : public torch::autograd::Function<PostBackward> {
  // Inputs arrive as a TensorList: a std::vector argument would be taken for a
  // non-tensor one, and the node would never join the graph.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                int64_t unit) {
    ctx->saved_data["unit"] = unit;
    return inputs.vec();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    reinterpret_cast<FsdpUnit*>(ctx->saved_data["unit"].toInt())->post_backward();
    grads.emplace_back();  // for the unit handle
    return grads;
  }
};

// How many of rank r's shard elements are real (the rest is padding).
int64_t real_length(const ShardedParam& p, int64_t r) {
  return std::clamp<int64_t>(p.numel() - r * p.shard_numel(), 0, p.shard_numel());
}

// Writes the shards of ranks [first, first + count) of a full parameter `full` (any shape)
// into rows [count, T] of `out` at column `offset`; padding positions are left as they are
// (zero in a fresh buffer), so no padded copy of the parameter is made.
void copy_rank_shards(at::Tensor& out, const at::Tensor& full, const ShardedParam& p, int64_t first, int64_t count,
                      int64_t offset) {
  const at::Tensor flat = full.reshape({-1});
  for (int64_t i = 0; i < count; ++i) {
    const int64_t length = real_length(p, first + i);
    if (length > 0) out[i].narrow(0, offset, length).copy_(flat.narrow(0, (first + i) * p.shard_numel(), length));
  }
}

}  // namespace

FsdpUnit::FsdpUnit(std::string name, std::vector<Module*> modules, std::vector<ShardedParam> params,
                   at::Tensor masters, at::Tensor constants, std::shared_ptr<Comm> shard_group,
                   std::shared_ptr<Comm> replicate_group, UnitOptions options, FsdpState* state)
    : name_(std::move(name)),
      modules_(std::move(modules)),
      params_(std::move(params)),
      masters_(std::move(masters)),
      constants_(std::move(constants)),
      comm_(std::move(shard_group)),
      replicate_group_(std::move(replicate_group)),
      options_(options),
      state_(state) {
  for (auto& p : params_) {
    // The module's own tensor takes the compute device and dtype, unallocated like any
    // sharded one; its values already sit in its shard.
    const auto dtype = options_.param_dtype.value_or(p.param.scalar_type());
    p.param.set_data(unallocated_tensor(p.param.sizes(), compute_options(dtype)));
    TORCH_CHECK(p.param.scalar_type() == params_.front().param.scalar_type(), "unit ", name_,
                " mixes parameter dtypes (", params_.front().name, ", ", p.name, ")");
    TORCH_CHECK(!p.param.requires_grad() || reduced_numel_ == flat_numel_, "unit ", name_,
                ": parameter ", p.name, " trains but follows a frozen one");
    flat_numel_ += p.shard_numel();
    if (p.param.requires_grad()) reduced_numel_ += p.shard_numel();
  }
  for (Module* m : modules_) m->set_activation_checkpointing(options_.activation_checkpoint);
  install_hooks();
}

FsdpUnit::~FsdpUnit() {
  for (auto& [module, id] : hooks_) module->remove_hook(id);
  if (unsharded_) free_params();  // parameters viewing viewed_ must not outlive it
}

void FsdpUnit::install_hooks() {
  Module* first = modules_.front();
  Module* last = modules_.back();
  hooks_.emplace_back(first, first->add_pre_forward_hook([this](Module&, Module::Tensors& inputs) {
    // A recomputation inside backward gathers and casts as the forward did, and no more.
    const bool recomputing = state_->in_backward();
    if (!recomputing) state_->on_pre_forward(this);
    unshard();
    if (options_.param_dtype) {
      for (auto& x : inputs) {
        if (x.defined() && x.is_floating_point() && x.scalar_type() != *options_.param_dtype) {
          x = x.to(*options_.param_dtype);
        }
      }
    }
    if (recomputing) return;
    std::vector<size_t> positions;
    torch::autograd::variable_list needing_grad;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].defined() && inputs[i].requires_grad()) {
        positions.push_back(i);
        needing_grad.push_back(inputs[i]);
      }
    }
    if (needing_grad.empty()) return;  // the end-of-backward callback reduces this unit
    auto routed = PostBackward::apply(at::TensorList(needing_grad), reinterpret_cast<int64_t>(this));
    for (size_t k = 0; k < positions.size(); ++k) inputs[positions[k]] = routed[k];
  }));
  // The hooks sit on the first and the last module listed, so the forward must call them in
  // that order: a later one called before the first would compute on parameters not gathered.
  for (size_t i = 1; i < modules_.size(); ++i) {
    Module* later = modules_[i];
    hooks_.emplace_back(later, later->add_pre_forward_hook([this, i](Module&, Module::Tensors&) {
      if (!unsharded_ && !state_->in_backward()) {
        throw UserError("unit " + name_ + ": the forward called its module " + std::to_string(i + 1) + " of " +
                        std::to_string(modules_.size()) + " (" + modules_[i]->class_name() + ") before the first (" +
                        modules_.front()->class_name() + ") or after the last; list a unit's modules in the order " +
                        "the forward calls them");
      }
    }));
  }
  hooks_.emplace_back(last, last->add_post_forward_hook([this](Module&, torch::Tensor& output) {
    const bool recomputing = state_->in_backward();  // backward goes on with them gathered
    if (!recomputing && options_.post_forward_group) {
      keep_post_forward_slice();
      free_params();
    } else if (!recomputing && options_.reshard_after_forward) {
      reshard();
    }
    if (options_.output_dtype && output.is_floating_point()) output = output.to(*options_.output_dtype);
    if (!recomputing && output.requires_grad()) {
      output.register_hook([this](const at::Tensor&) { pre_backward(); });
    }
  }));
}

void FsdpUnit::begin_unshard() {
  if (unsharded_ || gathered_.defined() || params_.empty()) return;  // done, or issued (a prefetch)
  // A training forward whose unit reshards after it gathers again in backward, from the
  // same masters: its cast shard is kept for that gather (1/world of the unit in the
  // compute dtype) rather than cast a second time.
  const bool backward_follows = at::GradMode::is_enabled() && !state_->in_backward() &&
                                options_.reshard_after_forward && !options_.post_forward_group;
  at::NoGradGuard no_grad;
  const int world = comm_->size();
  // Gathered in the parameters' own dtype (bf16 halves the traffic); masters stay fp32.
  const auto options = compute_options(params_.front().param.scalar_type());
  if (post_forward_slice_.defined()) {
    // The k ranks of the post-forward group hold the S/k-rank blocks in rank order.
    gathered_ = at::empty({world * flat_numel_}, options);
    gather_ = options_.post_forward_group->all_gather_async(gathered_, post_forward_slice_);
    post_forward_slice_ = at::Tensor();
    return;
  }
  at::Tensor flat = std::move(cast_shard_);
  if (!flat.defined()) flat = compute_shard(backward_follows);
  if (world == 1) {
    gathered_ = flat;  // one rank's shard is the whole
    return;
  }
  gathered_ = at::empty({world * flat_numel_}, options);
  // Issued from the copy stream when offloaded, the collective waits for the copy, not for
  // the compute queued meanwhile.
  beside_compute([&] { gather_ = comm_->all_gather_async(gathered_, flat); }, {gathered_, flat});
}

at::Tensor FsdpUnit::compute_shard(bool backward_follows) {
  await_update();
  const auto options = compute_options(params_.front().param.scalar_type());
  // Constants alone, already where the unit computes: the gather reads their buffer itself.
  if (masters_.numel() == 0 && constants_.device() == options_.device) return constants_;
  // A group of one computing in the masters' dtype where they live: the parameters view the
  // masters themselves, which change only in the optimizer's step, after the backward that
  // reads them.
  if (comm_->size() == 1 && constants_.numel() == 0 && masters_.scalar_type() == options.dtype().toScalarType() &&
      masters_.device() == options_.device) {
    return masters_;
  }
  // One copy (and cast) of the masters and one of the constants. Offloaded, they cross from
  // pinned host memory on the copy stream, in their own dtype, and are cast there: holding up
  // neither the host nor the compute.
  at::Tensor flat = at::empty({flat_numel_}, options);  // [T]
  const int64_t held = masters_.numel();
  copied_ = beside_compute(
      [&] {
        copy_cast(flat.narrow(0, 0, held), masters_);
        copy_cast(flat.narrow(0, held, flat_numel_ - held), constants_);
      },
      {flat});
  if (backward_follows && held > 0 && flat.scalar_type() != masters_.scalar_type()) cast_shard_ = flat;
  return flat;
}

std::optional<c10::Event> FsdpUnit::beside_compute(const std::function<void()>& enqueue,
                                                   std::initializer_list<at::Tensor> uses) {
  if (!options_.copy_stream) {
    enqueue();
    return std::nullopt;
  }
  return options_.copy_stream->run(enqueue, uses);
}

void FsdpUnit::unshard() {
  if (unsharded_ || params_.empty()) return;
  begin_unshard();
  gather_.wait();
  CopyStream::wait(copied_);
  fill_params(gathered_);
  gathered_ = at::Tensor();
  unsharded_ = true;
}

void FsdpUnit::for_each_full_value(const std::function<void(const std::string&, const at::Tensor&)>& visit) const {
  await_update();
  at::NoGradGuard no_grad;
  const int world = comm_->size();
  auto gather = [&](const at::Tensor& local) {  // [n] -> [S, n], rank-major
    at::Tensor out = at::empty({world * local.numel()}, local.options());
    if (local.numel() > 0) comm_->all_gather(out, local);
    return out.view({world, local.numel()});
  };
  const at::Tensor masters = gather(masters_), constants = gather(constants_);
  const int64_t held = masters_.numel();
  int64_t offset = 0;  // in the unit's shard [T]: the masters' M, then the constants
  for (const auto& p : params_) {
    const at::Tensor& by_rank = offset < held ? masters : constants;
    const int64_t column = offset < held ? offset : offset - held;
    // The rank-major shards concatenate to the full parameter followed by padding.
    const at::Tensor full = by_rank.narrow(1, column, p.shard_numel()).reshape({-1}).narrow(0, 0, p.numel());
    visit(p.name, full.view(p.param.sizes()));
    offset += p.shard_numel();
  }
}

void FsdpUnit::move_shards(c10::Device device, bool pinned) {
  await_update();
  TORCH_CHECK(!unsharded_ && !gathered_.defined() && !reduce_.pending(), "unit ", name_, ": moved while in use");
  at::NoGradGuard no_grad;
  cast_shard_ = at::Tensor();
  post_forward_slice_ = at::Tensor();
  reduced_grads_ = at::Tensor();
  masters_ = moved_to(masters_, device, pinned);
  if (constants_.defined()) constants_ = moved_to(constants_, device, pinned);
  const int64_t held = masters_.numel();
  int64_t offset = 0;  // in the unit's shard [T]: the masters' M, then the constants
  for (auto& p : params_) {
    // set_data keeps each tensor itself: the optimizer's groups and state map hold them.
    p.local.set_data(offset < held ? masters_.narrow(0, offset, p.shard_numel())
                                   : constants_.narrow(0, offset - held, p.shard_numel()));
    p.owned.set_data(p.local.narrow(0, 0, p.owned.numel()).view(p.owned.sizes()));
    offset += p.shard_numel();
  }
}

void FsdpUnit::move_grads(c10::Device device, bool pinned) {
  at::NoGradGuard no_grad;
  for (auto& p : params_) {
    if (p.owned.grad().defined()) p.owned.mutable_grad() = moved_to(p.owned.grad(), device, pinned);
  }
}

void FsdpUnit::fill_params(const at::Tensor& gathered) {
  const int world = comm_->size();
  if (world == 1) {
    // One rank's shard is every parameter end to end, unpadded: the parameters view it in
    // place instead of copying it (a kept cast shard then serves backward with no copy at all).
    viewed_ = gathered;
    int64_t offset = 0;
    for (auto& p : params_) {
      p.view_full(gathered, offset);
      offset += p.shard_numel();
    }
    return;
  }
  // Rank-major shards concatenate to the full tensor followed by padding: one batched copy
  // splits the gathered columns into each parameter's region of one buffer. One buffer, in
  // the unit's order, lays parameters of one shape built one after another (a MoE layer's
  // experts) at one stride, where a grouped product reads them in place.
  viewed_ = at::empty({world * flat_numel_}, gathered.options());
  const at::Tensor by_rank = gathered.view({world, flat_numel_});  // [S, T]
  std::vector<at::Tensor> outs;
  std::vector<int64_t> widths;
  int64_t offset = 0;
  for (auto& p : params_) {
    p.view_full(viewed_, offset);
    outs.push_back(viewed_.narrow(0, offset, world * p.shard_numel()).view({world, p.shard_numel()}));
    widths.push_back(p.shard_numel());
    offset += world * p.shard_numel();
  }
  at::split_with_sizes_copy_out(outs, by_rank, widths, /*dim=*/1);
}

void FsdpUnit::keep_post_forward_slice() {
  at::NoGradGuard no_grad;
  const int world = comm_->size();
  const int k = options_.post_forward_group->size();
  const int64_t block = world / k;  // ranks per slice
  const int64_t first = (comm_->rank() % k) * block;
  post_forward_slice_ = at::zeros({block, flat_numel_}, compute_options(params_.front().param.scalar_type()));
  int64_t offset = 0;
  for (auto& p : params_) {
    copy_rank_shards(post_forward_slice_, p.param.detach(), p, first, block, offset);
    offset += p.shard_numel();
  }
  post_forward_slice_ = post_forward_slice_.view({-1});
}

void FsdpUnit::release_cast_shard() { cast_shard_ = at::Tensor(); }

void FsdpUnit::reshard() {
  post_forward_slice_ = at::Tensor();
  // A prefetch nobody used: its buffers are the backend's, or the copy stream's, until it lands.
  gather_.wait();
  CopyStream::wait(copied_);
  gathered_ = at::Tensor();
  if (unsharded_) free_params();
}

void FsdpUnit::free_params() {
  for (auto& p : params_) p.free_full();
  viewed_ = at::Tensor();  // after the views end: the memory may be reused from here on
  unsharded_ = false;
}

void FsdpUnit::pre_backward() {
  state_->on_pre_backward(this);
  unshard();
}

}  // namespace fsdpp
