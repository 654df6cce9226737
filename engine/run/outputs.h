// The outputs a run writes at its end or as it goes, checked before the training.
#pragma once

#include "run/run_config.h"

namespace fsdpp {

// Refuses, in one line naming the key, a training run whose outputs would destroy files or be
// lost after the training: an export at the end ([checkpoint] save_final) into one of its
// own directories or over files no export wrote (io/hf_export.h's check_export_target), an
// adapter over files no adapter wrote, a [checkpoint] dir that cannot be made or written,
// and a [metrics] jsonl over a file that is not a run's metrics (a token file, weights).
// Every rank checks alike, before any rendezvous; the checkpoint directory is made here
// when the run can save (save_every, save_final or save_on_signal).
void check_outputs(const RunConfig& config);

}  // namespace fsdpp
