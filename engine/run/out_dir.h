// A run's output directory as one run's alone: the run records who it is there (run.json:
// its model, its data and its settings), refuses to train into a directory that holds
// another model's or data's run or, starting afresh, a run of other settings or its own
// checkpoints, and takes every checkpoint under its [checkpoint] dir inside out_dir as its
// own. A resumed run may change its settings (a learning rate, a batch size, timeouts), and
// is told which changed. [train] reuse_out_dir = true lifts the refusal and shares the
// directory: runs beside each other are then told apart by their settings, as are those in
// a [checkpoint] dir outside out_dir.
#pragma once

#include "run/run_config.h"

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>

namespace fsdpp {

// Who wrote an output directory.
struct RunIdentity {
  std::string model;        // [model] path, absolute
  std::string data;         // [data] train, absolute
  std::string config_hash;  // config_hash of its settings
  std::map<std::string, std::string> settings;  // run_settings; empty in records that predate them

  static RunIdentity of(const RunConfig& config);
};

// Refuses, in one line naming the directory and what to do, a run whose [train] out_dir holds
// another model's or data's run, or that starts afresh where a run of its own is. Beside other
// runs ([train] reuse_out_dir), it refuses instead a run that would start afresh over its own
// checkpoints, or save a step another run saved in a [checkpoint] dir they share. Every rank
// checks alike, before any rendezvous.
void check_out_dir(const RunConfig& config);
// Rank 0's hold on <out_dir>/.lock for as long as its run lives, so that a second run into
// the same directory (a job started twice) is refused instead of interleaving its
// checkpoints and metrics with this one's. A run with [train] reuse_out_dir = true shares
// the directory by choice with runs of other settings, and holds .lock-<settings hash>
// against one of its own settings; one of the Python API, which reads no [data], holds none.
class OutDirLock {
 public:
  // The lock, shared by this process's Runs into the directory (the Python API's several) and
  // held until the last of them ends (none for a Python API run beside others). UserError naming the directory
  // and the holder's process when another process holds it. A file system without locks
  // (some network mounts) goes unlocked.
  static std::unique_ptr<OutDirLock> claim(const RunConfig& config);
  ~OutDirLock();
  OutDirLock(const OutDirLock&) = delete;
  OutDirLock& operator=(const OutDirLock&) = delete;

 private:
  explicit OutDirLock(std::string key) : key_(std::move(key)) {}
  std::string key_;  // the directory, canonical
};

// Records the run in <out_dir>/run.json (rank 0, once its set-up succeeded: a run that was
// refused claims nothing), warning of the settings it changed from the run's record. A run
// beside others ([train] reuse_out_dir) records itself only in a directory with no record.
void record_run(const RunConfig& config);

// The settings in which `after` differs from `before`, key by key: "optimizer.lr 0.001 ->
// 0.005, data.batch_size 8 -> 9" (six named at most, then a count).
std::string settings_change(const std::map<std::string, std::string>& before,
                            const std::map<std::string, std::string>& after);

// Whether `checkpoint` is this run's: any directly under its own [checkpoint] dir where that
// lies inside its out_dir; elsewhere (a [checkpoint] dir outside out_dir, a directory the
// Python API saves into), one a run of its out_dir wrote (not sharing it), or one its present
// settings wrote; beside other runs ([train] reuse_out_dir), one its present settings wrote.
bool of_this_run(const RunConfig& config, const std::filesystem::path& checkpoint);
// Whether `output` (the export_dir or adapter_dir) lies in the run's out_dir, which the run
// owns, once a run of it recorded itself there (run.json), not beside other runs: a model or
// adapter there without a run's mark is taken for one older than the mark.
bool in_own_run_dir(const RunConfig& config, const std::string& output);
// The run's out_dir as its checkpoints record it (absolute, links resolved); "" for none.
std::string canonical_out_dir(const RunConfig& config);

// The newest complete checkpoint of this run under [checkpoint] dir.
std::optional<std::filesystem::path> latest_of_this_run(const RunConfig& config);
// The newest checkpoint of this run under `root` whose step is later than `step`:
// one a run that went back to an earlier checkpoint would leave behind it, which resume =
// "latest" would take and whose age would have rotation delete the earlier step's saves.
std::optional<std::filesystem::path> later_of_this_run(const RunConfig& config, const std::filesystem::path& root,
                                                       int64_t step);

}  // namespace fsdpp
