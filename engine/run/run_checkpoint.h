// A training run's whole state as a sharded checkpoint (io/sharded_checkpoint.h), written by
// Run::save (run/run_checkpoint.cpp) and read by Run::resume and Run::load
// (run/run_restore.cpp). Each rank saves its rows of every parameter and of AdamW's moments,
// plus its RNG state; rank 0 adds the metadata (step, meshes, config hash, schedule, data
// position, client state) and commits the directory. Restoring reads each rank's rows of the
// current sharding from whichever saved shards hold them, so a checkpoint loads at any world
// size or mesh.
#pragma once

#include "optim/adamw.h"
#include "run/run_config.h"

#include <filesystem>
#include <optional>
#include <string>
#include <utility>

namespace fsdpp {

// AdamW's moments, saved as "<key>/<name>" beside each parameter's "model/<name>".
inline constexpr std::pair<const char*, at::Tensor AdamW::ParamState::*> kSavedMoments[] = {
    {"exp_avg", &AdamW::ParamState::exp_avg}, {"exp_avg_sq", &AdamW::ParamState::exp_avg_sq}};

// The checkpoint [checkpoint] resume names, or nullopt to start fresh (none asked for, or
// "latest" with none of this run's saved yet). UserError when a named path is not a complete
// checkpoint.
std::optional<std::filesystem::path> resume_path(const RunConfig& config);

}  // namespace fsdpp
