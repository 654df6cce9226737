// Checkpoints of runs that share a [checkpoint] dir ([train] reuse_out_dir): step-N names no
// run, so each run keeps its own under checkpoints-<its settings' hash> by default, and a
// directory they share by choice is checked before a run trains, where a clash would
// otherwise surface at a save, after the training, or as a step silently kept.
#pragma once

#include "io/sharded_checkpoint.h"
#include "run/run_config.h"

#include <vector>

namespace fsdpp {

// Refuses, in one line naming the directory and what to do, a run beside others that would
// start afresh over checkpoints of its own, or save a step another run saved, in
// `checkpoints` (those of [checkpoint] dir); and one that resumes "latest" from its default
// directory while checkpoints of its own lie in <out_dir>/checkpoints.
void check_shared_checkpoints(const RunConfig& config, const std::vector<CheckpointEntry>& checkpoints);

}  // namespace fsdpp
