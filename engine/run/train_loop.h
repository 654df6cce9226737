// The training loop over a Run: the schedule's learning rate per step, the step's figures
// logged and written (metrics.jsonl, TensorBoard), held-out evaluation and periodic saves as
// [train] and [checkpoint] ask, a clean stop on SIGTERM or SIGINT, and the final export.
#pragma once

#include "run/run.h"

namespace fsdpp {

struct TrainSummary {
  int64_t steps = 0;
  int64_t skipped_steps = 0;
  double final_loss = 0.0;
  int stop_signal = 0;  // SIGTERM or SIGINT when a signal stopped the run early
};

// Builds the run, resumes it where the run file asks, and trains to [train] steps.
TrainSummary train(const RunConfig& config, const PlanBuilder& build_plan);

}  // namespace fsdpp
