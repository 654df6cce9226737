// Routing summed over ranks, and the figures made of it.
#include "loss/expert_balance.h"

#include "core/module_tree.h"
#include "fsdp/sharded_view.h"
#include "models/moe.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace fsdpp {

std::vector<std::string> routing_bias_names(Module& model) {
  std::vector<std::string> names;
  for (const auto& e : named_modules(model)) {
    for (const auto& item : e.module->named_parameters(/*recurse=*/false)) {
      if (e.module->updated_without_gradient(item.key())) names.push_back(e.path + "." + item.key());
    }
  }
  return names;
}

ExpertBalance::ExpertBalance(const MoeConfig& moe, const ExpertsConfig& config, std::vector<std::string> bias_names)
    : coefficient_(moe.router_aux_loss_coef),
      bias_update_rate_(config.bias_update_rate),
      bias_names_(std::move(bias_names)) {}

at::Tensor ExpertBalance::micro_batch_loss(RoutingLog& log, Comm& comm, int64_t micro_batches, double gradient_scale) {
  // One all-reduce carries the counts [L, E], the probability sums [E] (for the loss's value)
  // and the router rows, all as float64 (counts are exact in it far past any batch). All of it
  // stays on the routers' device, read on the host only once the step is done (finish_step):
  // a read here would hold the host until the device caught up, between forward and backward.
  const at::Tensor& first = log.layers.front().probability_sum;
  at::Tensor probability_sum = at::zeros(first.sizes(), first.options().dtype(at::kDouble));  // [E], detached
  std::vector<at::Tensor> layer_counts;  // [E] each
  double rows = 0;
  for (const auto& layer : log.layers) {
    layer_counts.push_back(layer.counts);
    probability_sum += layer.probability_sum.detach();
    rows += static_cast<double>(layer.selected.size(0));
  }
  const auto L = static_cast<int64_t>(log.layers.size()), E = probability_sum.size(0);
  at::Tensor global = at::cat({at::cat(layer_counts).to(probability_sum.options()), probability_sum,
                               at::full({1}, rows, probability_sum.options())});
  comm.all_reduce_sum(global);
  const auto counts = global.narrow(0, 0, L * E).view({L, E});  // [L, E]
  const auto global_rows = global.narrow(0, L * E + E, 1);       // [1]
  const auto global_counts = counts.sum(0);                      // [E]
  step_counts_ = step_counts_.defined() ? step_counts_ + counts : counts.clone();
  const auto aux = (global_counts * global.narrow(0, L * E, E)).sum() * static_cast<double>(E) /
                   (global_rows * global_rows);  // [1]
  aux_sum_ = aux_sum_.defined() ? aux_sum_ + aux : aux;
  ++micro_batches_seen_;
  const double weight = coefficient_ / static_cast<double>(micro_batches);
  return add_load_balancing_loss(log, global_counts, global_rows, weight * gradient_scale) / gradient_scale;
}

void ExpertBalance::update_routing_bias(ShardedView& view) const {
  if (bias_update_rate_ == 0 || !step_counts_.defined()) return;
  // Up where an expert got fewer tokens than its layer's mean, down where it got more.
  const auto delta = (step_counts_.mean(1, /*keepdim=*/true) - step_counts_).sign() * bias_update_rate_;  // [L, E]
  at::NoGradGuard no_grad;
  for (const auto& shard : view.shard_rows()) {
    const auto it = std::find(bias_names_.begin(), bias_names_.end(), shard.name);
    if (it == bias_names_.end() || shard.rows.size(0) == 0) continue;
    const auto layer = static_cast<int64_t>(it - bias_names_.begin());
    shard.rows.add_(delta[layer].narrow(0, shard.first_row, shard.rows.size(0)).to(shard.rows.options()));
  }
}

ExpertLoad ExpertBalance::finish_step() {
  ExpertLoad load;
  if (coefficient_ > 0 && micro_batches_seen_ > 0) {
    load.aux_loss = aux_sum_.item<double>() / static_cast<double>(micro_batches_seen_);
  }
  if (step_counts_.defined()) {
    const auto ratio = std::get<0>(step_counts_.max(1)) / step_counts_.mean(1).clamp_min(1e-30);  // [L]
    load.max_over_mean = ratio.max().item<double>();
  }
  step_counts_ = at::Tensor();
  aux_sum_ = at::Tensor();
  micro_batches_seen_ = 0;
  return load;
}

}  // namespace fsdpp
