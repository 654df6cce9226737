// Load balancing of mixture-of-experts models in training. After each micro-batch's forward,
// the routing of every MoE layer is summed over the ranks in one all-reduce; from it come this
// rank's share of the load-balancing loss (so N ranks equal one process holding the whole
// micro-batch) and the step's expert-load figures for the metrics.
#pragma once

#include "distributed/comm.h"
#include "models/model_config.h"

namespace fsdpp {

struct RoutingLog;

// The step's routing figures, the same on every rank.
struct ExpertLoad {
  double aux_loss = 0.0;  // the load-balancing loss before its weight, mean over micro-batches
  double max_over_mean = 0.0;  // tokens of the busiest expert over its layer's mean, worst layer
};

class ExpertBalance {
 public:
  // For a model with `moe` experts, training steps of `micro_batches` micro-batches.
  ExpertBalance(const MoeConfig& moe, int64_t micro_batches);

  // Adds the micro-batch's weighted load-balancing loss, divided over the step's
  // micro-batches, to its coming backward; returns this rank's share of its value (0-dim, no
  // grad). A collective over `comm`.
  at::Tensor micro_batch_loss(RoutingLog& log, Comm& comm);
  // The figures of the step the micro-batches so far made up; starts the next step.
  ExpertLoad finish_step();

 private:
  double coefficient_;
  int64_t micro_batches_;
  at::Tensor step_counts_;  // [L, E] float64: tokens routed per layer and expert this step, all ranks
  double aux_sum_ = 0.0;    // Σ over this step's micro-batches of the unweighted loss
};

}  // namespace fsdpp
