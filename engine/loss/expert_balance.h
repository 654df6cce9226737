// Load balancing of mixture-of-experts models in training. After each micro-batch's forward,
// the routing of every MoE layer is summed over the ranks in one all-reduce; from it come this
// rank's share of the load-balancing loss (so N ranks equal one process holding the whole
// micro-batch), the step's expert-load figures for the metrics and, where asked, DeepSeek-V3's
// update of the routing biases.
#pragma once

#include "distributed/comm.h"
#include "loss/experts_config.h"
#include "models/model_config.h"

#include <optional>
#include <string>
#include <vector>

namespace fsdpp {

class Module;
struct RoutingLog;
class ShardedView;

// The step's routing figures, the same on every rank.
struct ExpertLoad {
  std::optional<double> aux_loss;  // the load-balancing loss before its weight, mean over the step's micro-batches
  double max_over_mean = 0.0;      // tokens of the busiest expert over its layer's mean, worst layer
};

// The names of `model`'s routing biases (e_score_correction_bias, the parameters its modules
// say are updated without a gradient), one per MoE layer in layer order.
std::vector<std::string> routing_bias_names(Module& model);

class ExpertBalance {
 public:
  // For a model with `moe` experts whose routing biases are the parameters `bias_names`
  // (routing_bias_names).
  ExpertBalance(const MoeConfig& moe, const ExpertsConfig& config, std::vector<std::string> bias_names);

  // Adds the micro-batch's weighted load-balancing loss, divided over the `micro_batches` its
  // step has (a caller's own forward passes 1: each carries the whole weight, as a
  // transformers model's loss does), to its coming backward; returns this rank's share of its
  // value (0-dim, no grad). A collective over `comm`. The shares' gradients sum over the ranks
  // to the loss's; `gradient_scale` multiplies them for a caller that divides the summed
  // gradients after (by the world size, to average them).
  at::Tensor micro_batch_loss(RoutingLog& log, Comm& comm, int64_t micro_batches, double gradient_scale = 1.0);
  // After the optimizer step: moves each routing bias by bias_update_rate toward balance, in
  // this rank's rows of `view`, from the step's counts over every rank (so every rank moves
  // its rows alike).
  void update_routing_bias(ShardedView& view) const;
  // The figures of the step the micro-batches so far made up; starts the next step.
  ExpertLoad finish_step();

 private:
  double coefficient_;
  double bias_update_rate_;
  std::vector<std::string> bias_names_;
  int64_t micro_batches_seen_ = 0;  // this step's so far
  // On the routers' device, float64:
  at::Tensor step_counts_;  // [L, E] tokens routed per layer and expert this step, all ranks
  at::Tensor aux_sum_;      // [1] Σ over this step's micro-batches of the unweighted loss
};

}  // namespace fsdpp
