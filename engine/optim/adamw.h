// AdamW over groups of parameters with decoupled weight decay, using ATen's fused
// multi-tensor kernel; plus clipping by the global gradient norm.
#pragma once

#include "core/module_tree.h"
#include "fsdp/sharded_view.h"
#include "optim/optimizer_config.h"

#include <ATen/core/Tensor.h>

#include <future>
#include <optional>
#include <unordered_map>
#include <string>
#include <vector>

namespace fsdpp {

// How one step's gradients are clipped, as AdamW's fused kernel applies it: it divides every
// gradient by `divisor` and skips the whole update when `non_finite` is 1, so neither needs
// the host. A default GradClip clips nothing.
struct GradClip {
  at::Tensor norm;        // [1] double: the global norm before clipping
  at::Tensor divisor;     // [] float: (norm + 1e-6) / max_norm above max_norm, else 1, times the
                          // loss scale; undefined when neither clips nor scales
  at::Tensor non_finite;  // [] float: 1 when the norm is inf or nan, else 0
};

class AdamW {
 public:
  struct Group {
    std::string name;
    std::vector<at::Tensor> params;
    double weight_decay = 0.0;
  };

  AdamW(std::vector<Group> groups, const OptimizerConfig& config);
  ~AdamW();  // after the host thread's updates
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  // One update at learning rate `lr` from each parameter's .grad(), divided by the clip's
  // divisor and skipped when its norm is not finite (no clip: the gradients as they are).
  // Decided by the kernels themselves: queueing the update on a GPU waits for nothing (a host
  // update waits for the norm, as it waits for its gradients).
  // The parameters in `later`'s batches are updated on a host thread instead, batch after
  // batch, from the moment step() returns; the futures, one per batch, become ready as each
  // batch is updated (or carry its error). A step first waits for the previous step's.
  std::vector<std::shared_future<void>> step(double lr, const GradClip& clip = {},
                                            const std::vector<std::vector<at::Tensor>>& later = {});
  // Waits for the updates the last step left to the host thread, rethrowing their error: due
  // before the parameters are read or written other than through those futures.
  void settle() const;
  // Drops every gradient (the next backward makes fresh ones).
  void zero_grad();
  // Moves the moments and step counts to `device` (pinned when `pinned` and the host), or,
  // with no device, each next to its parameter: between the phases of a loop that lends the
  // device to another engine. Settles first.
  void move_state(std::optional<c10::Device> device, bool pinned);
  const std::vector<Group>& groups() const { return groups_; }

  // The moments and step count of `param` (one of the groups' tensors), settled; nullopt for a
  // tensor the optimizer does not update.
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
  std::vector<std::shared_future<void>> pending_;  // the last step's batches on the host thread
};

// Matrices (ndim >= 2) decay; biases, norm weights and other vectors do not.
std::vector<AdamW::Group> decay_groups(const std::vector<NamedParameter>& params, double weight_decay);

// The L2 norm over all gradients of all groups: each group's squared norm summed over its
// shard group (disjoint shards; replicas hold equal ones and are not counted twice), then
// over groups; the same on every rank. A gradient's norm already taken as it was made (the
// group's grad_norms: an offloaded gradient's, on the GPU) is used as it is. The sums stay on a
// GPU when any gradient or such norm is on one, so the host can read the norm once the whole
// step is queued (offloaded gradients without one are summed on the host, which waits for
// them). Gradients of a loss multiplied by `loss_scale` (optim/loss_scale.h) give the norm
// over that scale, and a divisor that removes it too.
GradClip clip_by_norm(const std::vector<GradGroup>& groups, double max_norm, double loss_scale = 1.0);

}  // namespace fsdpp
