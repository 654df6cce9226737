// fully_shard for a model: units built from a resolved plan (inner units first, the root
// last), the end-of-backward callback that reduces units whose inputs needed no gradient,
// and the sharded view the optimizer, clipping and checkpoints work on.
#pragma once

#include "core/module_tree.h"
#include "distributed/device_mesh.h"
#include "fsdp/backward_watch.h"
#include "fsdp/plan.h"
#include "fsdp/sharded_view.h"
#include "fsdp/unit.h"

#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace fsdpp {

// A meta-built model's first values as init_parameters would give them, each rank keeping
// only its own rows (each parameter is computed whole, one at a time, and sliced).
ShardFill fresh_init_fill(Module& root, uint64_t seed, double std);

class FsdpState : public ShardedView {
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
  std::vector<NamedParameter> sharded_parameters() const override;
  std::vector<ShardRows> shard_rows() const override;
  std::vector<std::string> mesh_shapes() const override;
  std::vector<GradGroup> grad_groups() const override;
  // One unit gathered at a time.
  void for_each_full_parameter(const std::function<void(const std::string&, const at::Tensor&)>& visit) override;
  // Also drops every unit's kept cast shards.
  void reshard_all() override;
  void set_requires_gradient_sync(bool sync) override { sync_ = sync; }
  // The trainable shards of the units whose masters live in host memory, unit by unit in the
  // order the next forward gathers them (then any unit the last forward skipped): the batches
  // of an update left to a host thread (AdamW::step's `later`).
  std::vector<std::vector<at::Tensor>> host_update_batches() const;
  // Those batches' updates, in the same order: each unit waits for its own before reading its
  // masters, and the unit before it in forward does not prefetch it while it is pending.
  void expect_host_updates(const std::vector<std::shared_future<void>>& updates);
  bool requires_gradient_sync() const { return sync_; }
  // What each reduced gradient is divided by as it joins its shard's .grad: 1 (the loss was
  // already divided by the step's global count), or the world size to average a caller's
  // per-rank losses, as DDP and FSDP2 do. Dividing there, not at the step, keeps a gradient
  // held across a step (no zero_grad) divided once.
  void set_gradient_divisor(double divisor) { gradient_divisor_ = divisor; }
  // Called as a backward through the units begins, before its first collective; what it throws
  // ends that backward before it starts. The Python API agrees there that every rank is in a
  // backward, so that a rank whose loop skipped one raises at once rather than wait out the
  // timeout in collectives the others never join.
  void set_backward_check(std::function<void()> check) { backward_check_ = std::move(check); }
  double gradient_divisor() const { return gradient_divisor_; }

  // Called by units from their hooks. A unit about to run issues its own gather and the
  // gather of the unit expected next (in forward: the one after it in the first forward's
  // order; in backward: the one before it), so the next unit's transfer overlaps this one's
  // compute. A new reduction moves those in flight one stage on (see FsdpUnit::advance_reduce).
  void on_pre_forward(FsdpUnit* unit);
  void on_pre_backward(FsdpUnit* unit);
  void on_reduce_issued(FsdpUnit* unit);
  bool in_backward() const { return in_backward_; }
  // Backwards through the units that have ended, whichever way: a count that a forward can
  // compare with the one at an earlier forward to know whether a backward came between.
  int64_t backwards_ended() const { return backwards_ended_; }
  // Which trainable parameters a backward brought a gradient to on this rank since
  // forget_gradients(), [P] double (1 or 0), in the same order on every rank. A backward that
  // stopped short of a unit (at the logits; a head the loss never read) still has it reduce
  // zeros, to stay in step with the other ranks, but brings it none.
  at::Tensor gradient_arrivals() const;
  // Drops the gradient of each parameter that `arrivals`, gradient_arrivals() summed over the
  // ranks, says no rank's backward reached: the optimizer leaves it alone, as torch's leave a
  // parameter without a gradient, rather than decay it and move it by its moments.
  void drop_unarrived_gradients(const at::Tensor& arrivals);
  void forget_gradients();
  // A call into the run from a thread of its own (the Python API's): holds the units for the
  // call's length, having waited out a backward that another thread runs; a backward that
  // begins meanwhile waits for the call to end before its first unit gathers. From inside the
  // backward (a hook that calls into the run) it waits for nothing.
  std::unique_lock<std::mutex> begin_call();
  // Within a call: puts right what a backward that ended in an exception left (see
  // abandon_backward), and says whether there was one. From inside the backward (a recomputation
  // the caller wraps) it does nothing.
  bool settle_backward();

 private:
  void final_callback();
  // Completes the reductions in flight into the shards' gradients and readies every unit
  // for the next forward.
  void end_backward();
  // A backward ended by an exception, its final callback dropped: the reductions it issued
  // complete into the shards' gradients, the gradients of units it had not reduced are
  // dropped, and every unit is resharded, so the next forward starts clean.
  void abandon_backward();
  FsdpUnit* neighbour_in_forward(FsdpUnit* unit, int step) const;
  std::vector<FsdpUnit*> host_updated_units() const;  // host_update_batches' units
  std::shared_ptr<Comm> post_forward_group(size_t mesh, int k);

  std::shared_ptr<Comm> world_;
  std::vector<DeviceMesh> meshes_;
  std::vector<size_t> unit_mesh_;  // unit -> index into meshes_
  std::map<std::pair<size_t, int>, std::shared_ptr<Comm>> post_forward_groups_;
  std::vector<std::unique_ptr<FsdpUnit>> units_;
  bool in_backward_ = false;
  int64_t backwards_ended_ = 0;
  BackwardWatch backward_;  // the backward in_backward_ stands for
  std::mutex calls_;        // held by a call (begin_call), and by a backward as it begins
  bool sync_ = true;
  std::function<void()> backward_check_;  // none: the binary's loop, whose ranks run alike
  double gradient_divisor_ = 1.0;
  std::vector<FsdpUnit*> forward_order_;  // units as the first forward ran them
  std::unordered_map<const FsdpUnit*, std::ptrdiff_t> forward_index_;  // unit -> its place in forward_order_
  bool recording_order_ = true;           // until that forward ends
  std::vector<FsdpUnit*> reducing_;       // units whose reductions are in flight, oldest first
  at::Device device_;
  CopyStream copy_stream_;  // the offloaded units' host<->device copies
  bool offloaded_ = false;  // some unit keeps its masters on the host while computing on a GPU
};

}  // namespace fsdpp
