// AdamW over groups of parameters with decoupled weight decay, using ATen's fused
// multi-tensor kernel; plus clipping by the global gradient norm.
#pragma once

#include "core/module_tree.h"
#include "fsdp/fsdp_state.h"
#include "train/optimizer_config.h"

#include <ATen/core/Tensor.h>

#include <optional>
#include <unordered_map>
#include <string>
#include <vector>

namespace fsdpp {

class AdamW {
 public:
  struct Group {
    std::string name;
    std::vector<at::Tensor> params;
    double weight_decay = 0.0;
  };

  AdamW(std::vector<Group> groups, const OptimizerConfig& config);

  // One update at learning rate `lr` from each parameter's .grad().
  void step(double lr);
  // Drops every gradient (the next backward makes fresh ones).
  void zero_grad();
  const std::vector<Group>& groups() const { return groups_; }

  // The moments and step count of `param` (one of the groups' tensors); nullopt for a tensor
  // the optimizer does not update.
  struct ParamState {
    at::Tensor exp_avg, exp_avg_sq, step;  // like param, like param, [] float
  };
  std::optional<ParamState> state_of(const at::Tensor& param) const;

 private:
  struct State {
    std::vector<at::Tensor> exp_avg, exp_avg_sq, steps;
  };
  std::vector<Group> groups_;
  std::vector<State> state_;
  std::unordered_map<const void*, std::pair<size_t, size_t>> where_;  // TensorImpl -> (group, index)
  OptimizerConfig config_;
};

// Matrices (ndim >= 2) decay; biases, norm weights and other vectors do not.
std::vector<AdamW::Group> decay_groups(const std::vector<NamedParameter>& params, double weight_decay);

// The L2 norm over all gradients of all groups: each group's squared norm summed over its
// shard group (disjoint shards; replicas hold equal ones and are not counted twice), then
// over groups. When finite and above `max_norm` (> 0), every gradient is scaled down to it.
// Returns the norm before clipping, the same on every rank.
double clip_grad_norm(const std::vector<GradGroup>& groups, double max_norm);

}  // namespace fsdpp
