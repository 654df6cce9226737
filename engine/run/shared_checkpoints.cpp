// The checks of shared_checkpoints.h, over the checkpoints' own records (of_this_run).
#include "run/shared_checkpoints.h"

#include "core/error.h"
#include "run/out_dir.h"
#include "run/run_checkpoint.h"

#include <algorithm>
#include <filesystem>

namespace fsdpp {

namespace fs = std::filesystem;

namespace {

// The step a run resumes after: its own newest in `checkpoints` (`own` tells which) for
// "latest", the named checkpoint's, or 0 for a fresh start.
int64_t resumed_step(const RunConfig& config, const std::vector<CheckpointEntry>& checkpoints,
                     const std::vector<bool>& own) {
  const ResumeFrom& resume = config.checkpoint.resume;
  if (resume.kind == ResumeFrom::Kind::path) return ShardedCheckpoint::open(*resume_path(config)).step();
  if (resume.kind == ResumeFrom::Kind::fresh) return 0;
  int64_t step = 0;
  for (size_t i = 0; i < checkpoints.size(); ++i) {
    if (own[i]) step = std::max(step, checkpoints[i].step);
  }
  return step;
}

// Whether a run that resumes after `resumed` saves step `step`: at each save_every, and at its
// end under save_final.
bool saves_step(const RunConfig& config, int64_t resumed, int64_t step) {
  const CheckpointConfig& c = config.checkpoint;
  if (step <= resumed || step > config.train.steps) return false;
  return (c.save_every > 0 && step % c.save_every == 0) || (c.save_final && step == config.train.steps);
}

// Checkpoints of this run in <out_dir>/checkpoints where [checkpoint] dir is left to its
// default, checkpoints-<hash>: "latest" would not find them, and the run would start afresh.
void check_left_behind(const RunConfig& config) {
  const fs::path shared = fs::path(config.train.out_dir) / "checkpoints";
  const bool dir_given = config.source.settings().contains("checkpoint.dir");
  if (dir_given || config.checkpoint.resume.kind != ResumeFrom::Kind::latest) return;
  std::error_code unreadable;
  if (!fs::is_directory(shared, unreadable)) return;
  for (const auto& c : list_checkpoints(shared)) {
    if (!of_this_run(config, c.path)) continue;
    throw UserError(shared.string() + ": holds this run's " + c.path.filename().string() + ", where its checkpoints " +
                    "beside other runs go to " + config.checkpoint.dir + "; move them there, or set [checkpoint] dir = \"" +
                    shared.string() + "\"");
  }
}

}  // namespace

void check_shared_checkpoints(const RunConfig& config, const std::vector<CheckpointEntry>& checkpoints) {
  const bool fresh = config.checkpoint.resume.kind == ResumeFrom::Kind::fresh;
  if (checkpoints.empty()) check_left_behind(config);
  std::vector<bool> own;  // each read from its metadata once
  for (const auto& c : checkpoints) own.push_back(of_this_run(config, c.path));
  const int64_t resumed = resumed_step(config, checkpoints, own);
  for (size_t i = 0; i < checkpoints.size(); ++i) {
    const CheckpointEntry& c = checkpoints[i];
    if (own[i] && fresh) {
      throw UserError(config.checkpoint.dir + ": holds this run's checkpoint " + c.path.filename().string() +
                      ", which it would start afresh over; resume it ([checkpoint] resume = \"latest\"), or "
                      "choose another [checkpoint] dir");
    }
    if (!own[i] && saves_step(config, resumed, c.step)) {
      throw UserError(config.checkpoint.dir + ": holds another run's checkpoint " + c.path.filename().string() +
                      ", a step this run would save too; choose another [checkpoint] dir");
    }
  }
}

}  // namespace fsdpp
