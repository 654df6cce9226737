// fully_shard for a model: units built from a resolved plan (inner units first, the root
// last), the end-of-backward callback that reduces units whose inputs needed no gradient,
// and the sharded view the optimizer, clipping and checkpoints work on.
#pragma once

#include "core/module_tree.h"
#include "distributed/device_mesh.h"
#include "fsdp/plan.h"
#include "fsdp/unit.h"

#include <functional>
#include <map>
#include <optional>
#include <unordered_map>

namespace fsdpp {

// A meta-built model's first values as init_parameters would give them, each rank keeping
// only its own rows (each parameter is computed whole, one at a time, and sliced).
ShardFill fresh_init_fill(Module& root, uint64_t seed, double std);

// This rank's rows of one parameter, as checkpoints save and load them.
struct ShardRows {
  std::string name;
  at::Tensor rows;                  // [owned_rows, ...] the fp32 master rows, the optimizer's parameter
  std::vector<int64_t> full_shape;  // the unsharded parameter's shape
  int64_t first_row = 0;            // where `rows` start in the full parameter
  bool primary = true;              // false on HSDP replicas after the first: they hold copies
};

// The owned shards of the units on one mesh, and the group their squared norms sum over.
struct GradGroup {
  std::vector<at::Tensor> params;
  Comm* shard_group = nullptr;
};

class FsdpState {
 public:
  // Shards every unit of `plan` over its mesh's shard group, building one DeviceMesh per
  // distinct shape (in plan order, the same on every rank); with a replicate group of
  // several ranks (HSDP) the reduced shards are then summed across replicas.
  // Parameters of a meta-built model get their values from `fill`. Units gather and compute
  // on `device`; their masters live there too unless the plan offloads them to the host.
  FsdpState(Module& root, std::shared_ptr<Comm> world, const ResolvedPlan& plan, const ShardFill& fill = {},
            at::Device device = at::kCPU);
  ~FsdpState();

  const std::vector<std::unique_ptr<FsdpUnit>>& units() const { return units_; }
  const Comm& world() const { return *world_; }
  // The owned rows of every parameter, named as in the model: the optimizer's parameters.
  std::vector<NamedParameter> sharded_parameters() const;
  std::vector<ShardRows> shard_rows() const;
  // "replicate x shard" of every mesh, in creation order.
  std::vector<std::string> mesh_shapes() const;
  // One group per mesh, for clipping by a single norm over every shard.
  std::vector<GradGroup> grad_groups() const;
  // Runs `visit(name, full tensor)` for every parameter with its full value, one unit
  // gathered at a time (a collective: every rank must call it).
  void for_each_full_parameter(const std::function<void(const std::string&, const at::Tensor&)>& visit);
  // Frees every unit's gathered parameters and kept cast shards: due before the optimizer
  // changes the masters.
  void reshard_all();
  // false: backwards keep full gradients and accumulate them; the next backward with sync
  // on reduce-scatters their sum (fewer collectives, full-size gradients held meanwhile).
  void set_requires_gradient_sync(bool sync) { sync_ = sync; }
  bool requires_gradient_sync() const { return sync_; }

  // Called by units from their hooks. A unit about to run issues its own gather and the
  // gather of the unit expected next (in forward: the one after it in the first forward's
  // order; in backward: the one before it), so the next unit's transfer overlaps this one's
  // compute. A new reduction moves those in flight one stage on (see FsdpUnit::advance_reduce).
  void on_pre_forward(FsdpUnit* unit);
  void on_pre_backward(FsdpUnit* unit);
  void on_reduce_issued(FsdpUnit* unit);
  bool in_backward() const { return in_backward_; }

 private:
  void final_callback();
  FsdpUnit* neighbour_in_forward(FsdpUnit* unit, int step) const;
  std::shared_ptr<Comm> post_forward_group(size_t mesh, int k);

  std::shared_ptr<Comm> world_;
  std::vector<DeviceMesh> meshes_;
  std::vector<size_t> unit_mesh_;  // unit -> index into meshes_
  std::map<std::pair<size_t, int>, std::shared_ptr<Comm>> post_forward_groups_;
  std::vector<std::unique_ptr<FsdpUnit>> units_;
  bool in_backward_ = false;
  bool sync_ = true;
  std::vector<FsdpUnit*> forward_order_;  // units as the first forward ran them
  std::unordered_map<const FsdpUnit*, std::ptrdiff_t> forward_index_;  // unit -> its place in forward_order_
  bool recording_order_ = true;           // until that forward ends
  std::vector<FsdpUnit*> reducing_;       // units whose reductions are in flight, oldest first
  at::Device device_;
  bool offloaded_ = false;  // some unit keeps its masters on the host while computing on a GPU
};

}  // namespace fsdpp
