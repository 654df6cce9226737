// The training loop, on one process or sharded over many: batches, forward, loss normalised
// by the step's target count, backward, global-norm clipping, AdamW, schedule, metrics,
// evaluation and periodic saves.
#pragma once

#include "fsdp/plan.h"
#include "models/causal_lm.h"
#include "train/run_config.h"

#include <functional>

namespace fsdpp {

struct TrainSummary {
  int64_t steps = 0;
  int64_t skipped_steps = 0;
  double final_loss = 0.0;
  int stop_signal = 0;  // SIGTERM or SIGINT when a signal stopped the run early
};

// Builds the wrap plan for the model at (world, rank): the policy, in the binary.
using PlanBuilder = std::function<Plan(CausalLM& model, int world, int rank)>;

TrainSummary train(const RunConfig& config, const PlanBuilder& build_plan);

}  // namespace fsdpp
