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

// The least bytes a training run's outputs take on disk.
struct OutputSizes {
  uint64_t checkpoint = 0;  // one checkpoint, every rank's files: the trainable masters and AdamW's two moments
  uint64_t exported = 0;    // the whole model's export at the end; 0 where none is written
  int64_t saves = 0;        // the checkpoints the run writes from where it starts
  int nodes = 1;            // nodes among which the checkpoint's files are written, each maybe to a disk of its own
};
// Refuses, naming the directory and every figure, a run whose [checkpoint] dir has no room for
// its first checkpoint, or whose export_dir none for the export after the last one: either
// would fail only after the training. Warns where the checkpoints the run holds at once (keep,
// and the one written before rotation deletes the oldest) outgrow the room there: the save
// that finds none stops the run. Sizes are lower bounds, so no run that fits is refused.
void check_room_for_outputs(const RunConfig& config, const OutputSizes& sizes);

}  // namespace fsdpp
