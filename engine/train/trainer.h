// The single-process training loop: batches, forward, loss normalised by the step's token
// count, backward, global-norm clipping, AdamW, schedule, metrics, periodic saves.
#pragma once

#include "train/run_config.h"

namespace fsdpp {

struct TrainSummary {
  int64_t steps = 0;
  int64_t skipped_steps = 0;
  double final_loss = 0.0;
};

TrainSummary train(const RunConfig& config);

// The evaluation token range a config names: the held-out tail of data.train when
// eval_fraction > 0, else all of it.
struct TokenRange {
  int64_t begin = 0, end = 0;
};
TokenRange train_range(const DataConfig& data, const TokenFile& tokens);
TokenRange eval_range(const DataConfig& data, const TokenFile& tokens);

}  // namespace fsdpp
