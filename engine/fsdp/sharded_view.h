// What training needs of the parameters it updates, however they are laid out: their shards
// (the optimizer's tensors, and what checkpoints save), the groups clipping sums gradient
// norms over, each parameter's full value (for export), and when gathered copies must go.
// FsdpState implements it, at one rank as at many; the optimizer's grouping, checkpoints,
// export and expert balancing see only this.
#pragma once

#include "core/module_tree.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace fsdpp {

class Comm;

// This rank's rows of one parameter, as checkpoints save and load them.
struct ShardRows {
  std::string name;
  at::Tensor rows;                  // [owned_rows, ...] the master rows, the optimizer's parameter (a
                                    // frozen one's may be in its compute dtype, with no master)
  std::vector<int64_t> full_shape;  // the unsharded parameter's shape
  int64_t first_row = 0;            // where `rows` start in the full parameter
  bool primary = true;              // false on HSDP replicas after the first: they hold copies
};

// The owned shards of the units on one mesh, and the group their squared norms sum over
// (none: this process holds every row).
struct GradGroup {
  std::vector<at::Tensor> params;
  Comm* shard_group = nullptr;
  // Empty, or one per parameter: the 2-norm of its gradient ([] float, on the device that made
  // the gradient) where one was taken as it was made, so clipping need not read the gradient
  // again; undefined where none was.
  std::vector<at::Tensor> grad_norms;
};

class ShardedView {
 public:
  virtual ~ShardedView() = default;

  // The owned rows of every parameter, named as in the model: the optimizer's parameters.
  virtual std::vector<NamedParameter> sharded_parameters() const = 0;
  // The same with where they sit in each full parameter, in for_each_full_parameter's order.
  virtual std::vector<ShardRows> shard_rows() const = 0;
  // "replicate x shard" of every mesh, in creation order.
  virtual std::vector<std::string> mesh_shapes() const = 0;
  // One group per mesh, for clipping by a single norm over every shard.
  virtual std::vector<GradGroup> grad_groups() const = 0;
  // Runs `visit(name, full tensor)` for every parameter with its full value as the optimizer
  // holds it (the masters, not their compute-dtype copies): a collective, every rank calls it.
  virtual void for_each_full_parameter(const std::function<void(const std::string&, const at::Tensor&)>& visit) = 0;
  // Frees gathered parameters and waits for the copies still reading the masters: due
  // before anything changes the masters (the optimizer, a checkpoint's load).
  virtual void reshard_all() = 0;
  // false: backwards keep full gradients and accumulate them; the next backward with sync
  // on reduces their sum.
  virtual void set_requires_gradient_sync(bool sync) = 0;
};

}  // namespace fsdpp
