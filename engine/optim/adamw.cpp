// AdamW and gradient clipping.
#include "optim/adamw.h"

#include "core/device.h"
#include "distributed/comm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <unordered_map>

namespace fsdpp {

AdamW::AdamW(std::vector<Group> groups, const OptimizerConfig& config)
    : groups_(std::move(groups)), config_(config) {
  for (const auto& g : groups_) {
    State s;
    for (const auto& p : g.params) {
      where_[p.unsafeGetTensorImpl()] = {state_.size(), s.exp_avg.size()};
      s.exp_avg.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
      s.exp_avg_sq.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
      s.steps.push_back(at::zeros({}, p.options().dtype(at::kFloat)));
    }
    state_.push_back(std::move(s));
  }
}

namespace {

// One fused call's tensors: parameters of one group on one device.
struct Batch {
  std::vector<at::Tensor> params, grads, exp_avg, exp_avg_sq, steps;
};

// The clip's tensors where a kernel runs.
struct ClipOn {
  std::optional<at::Tensor> divisor, skip;
};

void update(Batch& b, double lr, double weight_decay, const OptimizerConfig& config, const ClipOn& clip) {
  if (b.params.empty()) return;
  if (clip.skip) {
    at::_foreach_add_(b.steps, 1 - *clip.skip);  // a skipped update does not count
  } else {
    at::_foreach_add_(b.steps, 1);
  }
  at::_fused_adamw_(b.params, b.grads, b.exp_avg, b.exp_avg_sq, /*max_exp_avg_sqs=*/{}, b.steps, lr, config.beta1,
                    config.beta2, weight_decay, config.eps, /*amsgrad=*/false, /*maximize=*/false, clip.divisor,
                    clip.skip);
}

}  // namespace

AdamW::~AdamW() {
  for (const auto& update : pending_) update.wait();  // their tensors are this optimizer's
}

std::vector<std::shared_future<void>> AdamW::step(double lr, const GradClip& clip,
                                                  const std::vector<std::vector<at::Tensor>>& later) {
  at::NoGradGuard no_grad;
  settle();  // one step's host updates at a time, in order
  std::unordered_map<const void*, size_t> deferred;  // TensorImpl -> its batch in `later`
  for (size_t k = 0; k < later.size(); ++k) {
    for (const auto& p : later[k]) deferred[p.unsafeGetTensorImpl()] = k;
  }
  // Copied once per device.
  std::unordered_map<c10::Device, ClipOn> clips;
  auto clip_on = [&](c10::Device device) -> const ClipOn& {
    auto [it, fresh] = clips.try_emplace(device);
    if (fresh && clip.divisor.defined()) it->second.divisor = clip.divisor.to(device);
    if (fresh && clip.non_finite.defined()) it->second.skip = clip.non_finite.to(device);
    return it->second;
  };
  // Now: one fused call per group and device (offloaded units keep their shards on the host
  // while the rest of a group lives on the GPU). Later: one per group and batch.
  std::vector<std::unordered_map<c10::Device, Batch>> now(groups_.size());
  std::vector<std::vector<Batch>> held(later.size(), std::vector<Batch>(groups_.size()));
  for (size_t i = 0; i < groups_.size(); ++i) {
    for (size_t j = 0; j < groups_[i].params.size(); ++j) {
      const at::Tensor& p = groups_[i].params[j];
      if (!p.grad().defined()) continue;
      const auto it = deferred.find(p.unsafeGetTensorImpl());
      Batch& b = it == deferred.end() ? now[i][p.device()] : held[it->second][i];
      b.params.push_back(p);
      b.grads.push_back(p.grad());
      b.exp_avg.push_back(state_[i].exp_avg[j]);
      b.exp_avg_sq.push_back(state_[i].exp_avg_sq[j]);
      b.steps.push_back(state_[i].steps[j]);
    }
  }
  for (size_t i = 0; i < groups_.size(); ++i) {
    for (auto& [device, b] : now[i]) update(b, lr, groups_[i].weight_decay, config_, clip_on(device));
  }
  if (later.empty()) return {};
  std::vector<double> decays;
  for (const auto& g : groups_) decays.push_back(g.weight_decay);
  auto done = std::make_shared<std::vector<std::promise<void>>>(later.size());
  pending_.clear();
  for (auto& promise : *done) pending_.push_back(promise.get_future().share());
  // One task walks the batches in order, so the futures become ready in the order the caller
  // wants them; ATen's inter-op pool runs it with the caller's thread-local state (grad mode,
  // dispatch keys, the profiler), on threads whose kernels use the intra-op pool.
  const ClipOn& host_clip = clip_on(c10::Device(at::kCPU));
  at::launch([held = std::move(held), done, lr, decays, config = config_, clip = host_clip]() mutable {
    at::NoGradGuard no_grad;
    size_t k = 0;
    try {
      for (; k < held.size(); ++k) {
        for (size_t i = 0; i < held[k].size(); ++i) update(held[k][i], lr, decays[i], config, clip);
        held[k].clear();  // the gradients go as soon as they are spent
        (*done)[k].set_value();
      }
    } catch (...) {
      for (; k < held.size(); ++k) (*done)[k].set_exception(std::current_exception());
    }
  });
  return pending_;
}

void AdamW::settle() const {
  for (const auto& update : pending_) update.get();
}

std::optional<AdamW::ParamState> AdamW::state_of(const at::Tensor& param) const {
  settle();
  auto it = where_.find(param.unsafeGetTensorImpl());
  if (it == where_.end()) return std::nullopt;
  const auto [i, j] = it->second;
  return ParamState{state_[i].exp_avg[j], state_[i].exp_avg_sq[j], state_[i].steps[j]};
}

void AdamW::move_state(std::optional<c10::Device> device, bool pinned) {
  settle();
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < groups_.size(); ++i) {
    for (size_t j = 0; j < groups_[i].params.size(); ++j) {
      const c10::Device to = device.value_or(groups_[i].params[j].device());
      for (auto* state : {&state_[i].exp_avg, &state_[i].exp_avg_sq, &state_[i].steps}) {
        // set_data keeps each tensor itself, as state_of's readers and checkpoints hold it.
        (*state)[j].set_data(moved_to((*state)[j], to, pinned));
      }
    }
  }
}

void AdamW::zero_grad() {
  // Dropped rather than zeroed: the next backward's reduction then hands each shard a
  // fresh buffer, where a zeroed one would cost a fill now and an add later.
  for (auto& g : groups_) {
    for (auto& p : g.params) p.mutable_grad() = at::Tensor();
  }
}

std::vector<AdamW::Group> decay_groups(const std::vector<NamedParameter>& params, double weight_decay) {
  AdamW::Group decay{"decay", {}, weight_decay};
  AdamW::Group no_decay{"no_decay", {}, 0.0};
  for (const auto& p : params) {
    if (!p.tensor.requires_grad()) continue;
    (p.tensor.dim() >= 2 ? decay : no_decay).params.push_back(p.tensor);
  }
  std::vector<AdamW::Group> groups;
  for (auto* g : {&decay, &no_decay}) {
    if (!g->params.empty()) groups.push_back(std::move(*g));
  }
  return groups;
}

namespace {

// The norm already taken of group.params[i]'s gradient, if any.
at::Tensor known_norm(const GradGroup& group, size_t i) {
  return i < group.grad_norms.size() ? group.grad_norms[i] : at::Tensor();
}

// Where the norm is summed: a GPU holding any of the gradients or their known norms, else the host.
c10::Device norm_device(const std::vector<GradGroup>& groups) {
  for (const auto& group : groups) {
    for (size_t i = 0; i < group.params.size(); ++i) {
      const at::Tensor& grad = group.params[i].grad();
      if (!grad.defined()) continue;
      const at::Tensor norm = known_norm(group, i);
      const c10::Device device = norm.defined() ? norm.device() : grad.device();
      if (!device.is_cpu()) return device;
    }
  }
  return c10::Device(c10::kCPU);
}

}  // namespace

GradClip clip_by_norm(const std::vector<GradGroup>& groups, double max_norm, double loss_scale) {
  at::NoGradGuard no_grad;
  const c10::Device home = norm_device(groups);
  at::Tensor square_total = at::zeros({1}, at::TensorOptions(at::kDouble).device(home));
  for (const auto& group : groups) {
    // Norms are taken where the gradients live (a GPU, or the host for offloaded units), unless
    // one was taken as the gradient was made.
    std::unordered_map<c10::Device, std::vector<at::Tensor>> local, norms;
    for (size_t i = 0; i < group.params.size(); ++i) {
      const at::Tensor& grad = group.params[i].grad();
      if (!grad.defined() || grad.numel() == 0) continue;
      if (const at::Tensor norm = known_norm(group, i); norm.defined()) {
        norms[norm.device()].push_back(norm);
      } else {
        local[grad.device()].push_back(grad);
      }
    }
    for (const auto& [device, on_device] : local) {
      auto& taken = norms[device];
      for (auto& norm : at::_foreach_norm(on_device, 2)) taken.push_back(std::move(norm));
    }
    // Squares add across shards, so one all-reduce of the local sum gives the group's share.
    at::Tensor square_sum = at::zeros({1}, square_total.options());
    for (const auto& [device, on_device] : norms) {
      square_sum += at::stack(on_device).to(at::kDouble).pow(2).sum().to(home);
    }
    if (group.shard_group != nullptr) group.shard_group->all_reduce_sum(square_sum);
    square_total += square_sum;
  }
  GradClip clip;
  clip.norm = loss_scale == 1.0 ? square_total.sqrt() : square_total.sqrt() / loss_scale;
  clip.non_finite = clip.norm.isfinite().logical_not().to(at::kFloat).reshape({});
  if (max_norm > 0) {
    // A norm of nan compares false and divides by 1; the update is skipped anyway.
    clip.divisor = at::where(clip.norm > max_norm, (clip.norm + 1e-6) / max_norm, at::ones_like(clip.norm));
  }
  if (loss_scale != 1.0) clip.divisor = clip.divisor.defined() ? clip.divisor * loss_scale : at::full_like(clip.norm, loss_scale);
  if (clip.divisor.defined()) clip.divisor = clip.divisor.to(at::kFloat).reshape({});
  return clip;
}

}  // namespace fsdpp
