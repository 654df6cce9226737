// Reducing one unit's gradients (fsdp/unit.h): post-backward cuts every gradient into the
// ranks' blocks in one batched copy and starts their reduce-scatter; the state advances it
// (and HSDP's sum over the replicas) while later units compute; then each rank adds its
// reduced block to its masters' gradients, in host memory where the masters are offloaded.
#include "fsdp/unit.h"

#include "fsdp/fsdp_state.h"

#include <ATen/ATen.h>

namespace fsdpp {

bool FsdpUnit::awaits_reduction() const {
  return !reduced_ || std::any_of(params_.begin(), params_.end(), [](const ShardedParam& p) {
    return p.param.requires_grad() && p.param.grad().defined();
  });
}

void FsdpUnit::drop_unreduced() {
  for (auto& p : params_) p.param.mutable_grad() = at::Tensor();
  cast_shard_ = at::Tensor();
  reshard();
}

void FsdpUnit::post_backward() {
  // The engine sums a parameter's gradients from every forward that used it before it
  // accumulates them once. Where one loss spans several forwards, a forward's post-backward
  // may come before that (the unit reduces what it holds: nothing yet) and the last one's
  // after it, so every gradient is reduced once, whatever the order.
  finish_reduce();  // a reduction of this backward's earlier forward still in flight
  reduced_ = true;
  cast_shard_ = at::Tensor();
  for (auto& p : params_) p.gradient_arrived |= p.param.grad().defined();
  if (!state_->requires_gradient_sync()) {
    // Accumulating without sync: the full gradients stay until a synced backward reduces
    // their sum once.
    reshard();
    return;
  }
  at::NoGradGuard no_grad;
  const int world = comm_->size();
  if (reduced_numel_ == 0) {  // nothing here trains
    reshard();
    return;
  }
  // Each gradient cut into `world` blocks of padded_rows rows, block r of every parameter to
  // row r, zero-padded and cast to the reduction's dtype: one batched copy.
  std::vector<at::Tensor> grads;
  for (auto& p : params_) {
    if (!p.param.requires_grad()) break;  // the frozen rest, which no reduction carries
    at::Tensor grad = p.param.grad();
    p.param.mutable_grad() = at::Tensor();
    if (p.shard_numel() == 0) continue;
    // Row-major, as the chunked copy reads it; a parameter that got no gradient reduces zeros.
    grads.push_back(grad.defined() ? grad.contiguous().view({p.rows, p.row_numel})
                                   : at::zeros({p.rows, p.row_numel}, p.param.options()));
  }
  if (world == 1 && replicate_group_->size() == 1 && grads.front().scalar_type() == options_.reduce_dtype) {
    // Nothing to sum and nothing to cast: each gradient is its parameter's whole shard.
    size_t next = 0;
    for (auto& p : params_) {
      if (!p.param.requires_grad()) break;
      if (p.shard_numel() > 0) accumulate_shard(p, grads[next++].view(p.owned.sizes()));
    }
    reshard();
    return;
  }
  at::Tensor scattered_in = at::empty({world, reduced_numel_}, compute_options(options_.reduce_dtype));  // [W, R]
  at::_chunk_cat_out(scattered_in, grads, /*dim=*/0, /*num_chunks=*/world);
  if (world == 1) {
    reduced_grads_ = scattered_in.view({-1});  // one rank's sum is its own gradient
  } else {
    reduced_grads_ = at::empty({reduced_numel_}, scattered_in.options());
    reduce_ = comm_->reduce_scatter_sum_async(reduced_grads_, scattered_in.view({-1}));
  }
  reshard();
  state_->on_reduce_issued(this);
}

bool FsdpUnit::advance_reduce() {
  if (!reduced_grads_.defined()) return true;
  if (!replicas_summing_) {
    reduce_.wait();
    if (replicate_group_->size() > 1) {
      // HSDP: the replicas' sum stays in flight too, finished at the next advance.
      replica_reduce_ = replicate_group_->all_reduce_sum_async(reduced_grads_);
      replicas_summing_ = true;
      return false;
    }
  }
  replica_reduce_.wait();
  replicas_summing_ = false;
  accumulate_reduced();
  return true;
}

void FsdpUnit::finish_reduce() {
  while (!advance_reduce()) {
  }
}

void FsdpUnit::accumulate_reduced() {
  at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (auto& p : params_) {
    if (!p.param.requires_grad()) break;
    accumulate_shard(p, reduced_grads_.narrow(0, offset, p.owned_rows * p.row_numel).view(p.owned.sizes()));
    offset += p.shard_numel();
  }
  reduced_grads_ = at::Tensor();
}

void FsdpUnit::accumulate_shard(ShardedParam& p, const at::Tensor& reduced) {
  // The fresh buffer itself (a new tensor when the reduction ran in another dtype or the
  // masters live elsewhere), so a first gradient needs no copy: the reduction's own, or the
  // gradient a world of one handed over, so dividing it in place changes nothing else.
  at::Tensor shard = reduced.to(p.owned.scalar_type());
  if (const double divisor = state_->gradient_divisor(); divisor != 1.0) shard.div_(divisor);
  if (shard.device() == p.owned.device()) {
    if (p.owned.grad().defined()) {
      p.owned.mutable_grad().add_(shard);
    } else {
      p.owned.mutable_grad() = shard;
    }
    return;
  }
  // Offloaded: into pinned host memory on the copy stream, holding up neither the host nor
  // the compute. The state waits for the copies before anything reads them, then adds each
  // to a gradient already there.
  at::Tensor host = at::empty(p.owned.sizes(), p.owned.options().pinned_memory(true));
  beside_compute([&] { host.copy_(shard, /*non_blocking=*/true); }, {shard});
  if (p.owned.grad().defined()) {
    host_grad_sums_.emplace_back(p.owned.grad(), host);
  } else {
    p.owned.mutable_grad() = host;
    // Its norm, taken on the device as it leaves: clipping then reads no offloaded gradient
    // on the host (a sum added later makes this one stale).
    p.note_grad_norm(at::linalg_vector_norm(shard));
  }
}

void FsdpUnit::add_host_gradients() {
  for (auto& [grad, arrived] : host_grad_sums_) grad.add_(arrived);
  host_grad_sums_.clear();
}

}  // namespace fsdpp
