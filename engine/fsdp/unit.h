// A unit: the parameters of one wrap, gathered with one flat all-gather before use and
// reduced with one flat reduce-scatter after backward. SHARDED -> UNSHARDED -> SHARDED.
// Both collectives run asynchronously: a gather may be issued early (prefetch) and waited
// for when the unit runs; a reduction is finished when the next unit's starts.
#pragma once

#include "core/copy_stream.h"
#include "core/module.h"
#include "distributed/comm.h"
#include "fsdp/sharded_param.h"

#include <chrono>
#include <future>
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
  at::Device device = at::kCPU;  // where the unit gathers, computes and reduces (offloaded masters stay on the host)
  CopyStream* copy_stream = nullptr;  // set: the shards live on the host of a device run, copied beside the compute
};

class FsdpUnit {
 public:
  // The params' `local` shards are slices of two flat buffers, in the params' order:
  // `masters` [M] (fp32, or fp64) for the leading ones, `constants` [T - M] in the compute
  // dtype for the frozen rest that has no master.
  FsdpUnit(std::string name, std::vector<Module*> modules, std::vector<ShardedParam> params, at::Tensor masters,
           at::Tensor constants, std::shared_ptr<Comm> shard_group, std::shared_ptr<Comm> replicate_group,
           UnitOptions options, FsdpState* state);
  ~FsdpUnit();

  const std::string& name() const { return name_; }
  std::vector<ShardedParam>& params() { return params_; }
  bool is_unsharded() const { return unsharded_; }
  // A gather issued (a prefetch) and not yet written into the module tensors.
  bool is_gathering() const { return gathered_.defined(); }
  // A forward's cast shard kept for backward's gather.
  bool keeps_cast_shard() const { return cast_shard_.defined(); }

  // The update of this unit's masters that AdamW left to a host thread: reading the masters
  // (a gather, the full values, a move) waits for it first.
  void expect_update(std::shared_future<void> update) { update_ = std::move(update); }
  bool update_pending() const {
    return update_.valid() && update_.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
  }
  // Issues the all-gather of every parameter (no-op when unsharded or already issued).
  void begin_unshard();
  // Waits for the gather and writes it into the module tensors (no-op when unsharded).
  void unshard();
  // Releases the gathered storage (waiting out a gather still in flight).
  void reshard();
  // Drops the compute-dtype shard a forward kept for backward's gather: due before the
  // masters change.
  void release_cast_shard();
  // Issues the reduce-scatter of the gradients the gathered parameters hold, drops them and
  // reshards. Once per forward's backward: a loss over several forwards reduces each
  // forward's part as its backward passes the unit, and the reductions add up in the shards.
  void post_backward();
  // Whether the end of the backward must still reduce the unit: its post-backward never ran
  // (its inputs needed no gradient), or gradients arrived after it did.
  bool awaits_reduction() const;
  // After a backward that ended in an exception: drops the full gradients it did not reduce
  // and the gathered parameters.
  void drop_unreduced();
  // Moves the reduction one stage on: waits for the reduce-scatter and, under HSDP, issues
  // the replicas' all-reduce; or waits for that all-reduce. Once the reduction is complete,
  // sums it into the owned shards' .grad and returns true. Offloaded gradients are copied to
  // the host asynchronously: add_host_gradients() completes the sum once the device is done.
  bool advance_reduce();
  // Advances the reduction until it is complete.
  void finish_reduce();
  void add_host_gradients();
  void pre_backward();
  void end_backward() { reduced_ = false; }
  // Runs visit(name, full value) for each parameter from what the optimizer holds: its masters
  // (a frozen parameter's compute-dtype shard where it has none), gathered over the shard
  // group, whatever dtype the unit computes in. A collective over the shard group.
  void for_each_full_value(const std::function<void(const std::string&, const at::Tensor&)>& visit) const;
  // Between the phases of a loop that lends the device to another engine (resharded, no
  // backward in flight): moves the unit's shards, or its owned gradients, to `device` (pinned
  // when `pinned` and the host), each parameter keeping its tensor, so the optimizer's hold
  // on it stands; drops the buffers a step keeps for the next one.
  void move_shards(c10::Device device, bool pinned);
  void move_grads(c10::Device device, bool pinned);
  // Where the shards live while the run trains: the host when offloaded by the plan, else the
  // compute device.
  c10::Device home() const { return options_.copy_stream ? c10::Device(at::kCPU) : options_.device; }

 private:
  void await_update() const {
    if (update_.valid()) update_.get();
  }
  void install_hooks();
  void keep_post_forward_slice();
  void accumulate_reduced();  // reduced_grads_ -> the owned shards' .grad
  // Sums one parameter's reduced gradient [owned sizes] into its owned shard's .grad.
  void accumulate_shard(ShardedParam& p, const at::Tensor& reduced);
  void fill_params(const at::Tensor& gathered);  // [S * T] rank-major shards -> module tensors
  void free_params();
  at::Tensor compute_shard(bool backward_follows);  // [T] what this rank contributes to a gather
  // Enqueues work that crosses between host and device: on the copy stream when the shards
  // live on the host of a device run (returning the event it ends at), else in place.
  std::optional<c10::Event> beside_compute(const std::function<void()>& enqueue, std::initializer_list<at::Tensor> uses);
  at::TensorOptions compute_options(at::ScalarType dtype) const { return at::TensorOptions().dtype(dtype).device(options_.device); }

  std::string name_;
  std::vector<Module*> modules_;
  std::vector<ShardedParam> params_;
  at::Tensor masters_;             // [M] the leading params' local shards, in order
  at::Tensor constants_;           // [T - M] the rest's, in the compute dtype
  std::shared_ptr<Comm> comm_;            // the shard group
  std::shared_ptr<Comm> replicate_group_; // HSDP replicas, summed after the reduce-scatter
  UnitOptions options_;
  FsdpState* state_;
  int64_t flat_numel_ = 0;  // Σ padded shard sizes
  int64_t reduced_numel_ = 0;  // of flat_numel_, the leading parameters that train: what backward reduces
  bool unsharded_ = false;
  at::Tensor gathered_;            // [S * T] filled by gather_
  at::Tensor cast_shard_;          // [T] compute_shard() kept from forward for backward
  at::Tensor viewed_;              // what the unsharded parameters view: the gathered [T] in a
                                   // group of one, else [S * T] with each parameter's shards together
  CommWork gather_;
  std::optional<c10::Event> copied_;  // the copy stream's fill of gathered_'s source, not yet waited for
  at::Tensor post_forward_slice_;  // [S/k, T] the rows of S/k ranks, kept between forward and backward
  bool reduced_ = false;  // post_backward ran in this backward
  at::Tensor reduced_grads_;       // [T] this rank's summed gradient rows, filled by reduce_
  CommWork reduce_;
  CommWork replica_reduce_;        // HSDP: the replicas' sum of reduced_grads_
  bool replicas_summing_ = false;  // replica_reduce_ issued, the reduce-scatter done
  std::vector<std::pair<at::Tensor, at::Tensor>> host_grad_sums_;  // (host .grad, its copy in flight)
  std::vector<std::pair<Module*, int>> hooks_;
  std::shared_future<void> update_;  // expect_update's; get() rethrows the update's error
};

}  // namespace fsdpp
