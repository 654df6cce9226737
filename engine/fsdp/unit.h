// A unit: the parameters of one wrap, gathered with one flat all-gather before use and
// reduced with one flat reduce-scatter after backward. SHARDED -> UNSHARDED -> SHARDED.
#pragma once

#include "core/module.h"
#include "dist/comm.h"
#include "fsdp/sharded_param.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdpp {

class FsdpState;

struct UnitOptions {
  bool reshard_after_forward = true;  // free gathered params after forward, re-gather in backward
  std::shared_ptr<Comm> post_forward_group;  // set: keep 1/k after forward, gather over these k
  bool activation_checkpoint = false; // recompute the unit's forward in backward
  std::optional<at::ScalarType> param_dtype;         // gather and compute in this (masters stay fp32)
  at::ScalarType reduce_dtype = at::kFloat;          // dtype of the reduce-scatter
  std::optional<at::ScalarType> output_dtype;        // cast the unit's output to this
};

class FsdpUnit {
 public:
  FsdpUnit(std::string name, std::vector<Module*> modules, std::vector<ShardedParam> params,
           std::shared_ptr<Comm> shard_group, std::shared_ptr<Comm> replicate_group, UnitOptions options,
           FsdpState* state);
  ~FsdpUnit();

  const std::string& name() const { return name_; }
  std::vector<ShardedParam>& params() { return params_; }
  bool is_unsharded() const { return unsharded_; }

  // All-gathers every parameter into its module tensor (no-op when already unsharded).
  void unshard();
  // Releases the gathered storage.
  void reshard();
  // Reduce-scatters the gradients of the gathered parameters into the owned shards' .grad
  // (summed into any already there), drops the full gradients and reshards. Once per backward.
  void post_backward();
  void pre_backward();
  void end_backward() { reduced_ = false; }

 private:
  void install_hooks();
  void keep_post_forward_slice();
  void copy_out(const at::Tensor& by_rank);  // [S, T] rank-major shards -> module tensors

  std::string name_;
  std::vector<Module*> modules_;
  std::vector<ShardedParam> params_;
  std::shared_ptr<Comm> comm_;            // the shard group
  std::shared_ptr<Comm> replicate_group_; // HSDP replicas, summed after the reduce-scatter
  UnitOptions options_;
  FsdpState* state_;
  int64_t flat_numel_ = 0;  // Σ padded shard sizes
  bool unsharded_ = false;
  at::Tensor post_forward_slice_;  // [S/k, T] the rows of S/k ranks, kept between forward and backward
  bool reduced_ = false;
  std::vector<std::pair<Module*, int>> hooks_;
};

}  // namespace fsdpp
