// The outputs a run writes at its end or as it goes (the export, the adapter, checkpoints,
// metrics and TensorBoard's files), checked at its start: a place the run cannot write, or
// one whose files the run would destroy, is refused before the training that fills it.
#include "run/outputs.h"

#include "core/error.h"
#include "core/log.h"
#include "io/hf_export.h"
#include "io/peft_adapter.h"
#include "io/sharded_checkpoint.h"
#include "run/out_dir.h"

#include <nlohmann/json.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace fsdpp {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// "file:line: [section] key: " opening an output path's messages; a path the file leaves
// unset lies in [train] out_dir, whose line is named.
std::string output_where(const RunConfig& config, const std::string& section, const std::string& key) {
  const std::string name = "[" + section + "] " + key;
  if (config.source.settings().contains(section + "." + key)) {
    return config.source.where(section, key) + ": " + name + ": ";
  }
  return config.source.where("train", "out_dir") + ": " + name + " (unset: in [train] out_dir): ";
}

// Refuses a directory that `what` at the end replaces whole where it holds the run's own
// out_dir, checkpoints or model.
void check_holds_none_of_the_run(const RunConfig& config, const fs::path& dir, const std::string& where,
                                 const std::string& what) {
  for (const auto& [key, path] : {std::pair<const char*, fs::path>{"[train] out_dir", config.train.out_dir},
                                  {"[checkpoint] dir", config.checkpoint.dir},
                                  {"[model] path", config.model.path}}) {
    if (path_within(path, dir)) {
      throw UserError(where + dir.string() + " holds " + key + " " + path.string() + ", which " + what +
                      " at the end would replace; choose another directory");
    }
  }
}

// An output written at the end into .partial-<name> beside `dir`, then renamed: a directory is
// made there and removed now, so that a place the run cannot write is found before the
// training that fills it.
void check_can_write_beside(const fs::path& dir, const std::string& where) {
  fs::path target = fs::absolute(dir).lexically_normal();
  if (!target.has_filename()) target = target.parent_path();
  const fs::path parent = target.parent_path();
  std::error_code error;
  fs::create_directories(parent, error);
  if (!error) {
    const fs::path probe = parent / (".probe-" + target.filename().string() + "-" + std::to_string(::getpid()));
    fs::create_directory(probe, error);
    std::error_code ignored;
    fs::remove(probe, ignored);
  }
  if (error) throw UserError(where + dir.string() + ": cannot write beside it in " + parent.string() + ": " + error.message());
}

void check_export_dir(const RunConfig& config) {
  const fs::path dir = config.checkpoint.export_dir;
  const std::string where = output_where(config, "checkpoint", "export_dir");
  check_holds_none_of_the_run(config, dir, where, "the export");
  check_can_write_beside(dir, where);
  try {
    check_export_target(dir, in_own_run_dir(config, config.checkpoint.export_dir));
  } catch (const UserError& e) {
    throw UserError(where + e.what());
  }
}

void check_adapter_dir(const RunConfig& config) {
  const std::string where = output_where(config, "checkpoint", "adapter_dir");
  check_holds_none_of_the_run(config, config.checkpoint.adapter_dir, where, "the adapter");
  check_can_write_beside(config.checkpoint.adapter_dir, where);
  try {
    check_adapter_target(config.checkpoint.adapter_dir, in_own_run_dir(config, config.checkpoint.adapter_dir));
  } catch (const UserError& e) {
    throw UserError(where + e.what());
  }
}

// The output directory [section] key names, made now: a path the run cannot write into is
// found before the model loads and the training that fills it.
void make_writable_dir(const RunConfig& config, const std::string& section, const std::string& key,
                       const fs::path& dir) {
  const std::string where = output_where(config, section, key) + dir.string();
  std::error_code error;
  fs::create_directories(dir, error);
  if (error) throw UserError(where + ": cannot make it: " + error.message());
  if (::access(dir.c_str(), W_OK | X_OK) != 0) throw UserError(where + ": cannot write into it: " + std::strerror(errno));
}

// A run truncates its metrics file at start: a regular file there must be a run's metrics
// (a device such as /dev/null, or a pipe, is the user's way to send them elsewhere).
void check_metrics_file(const RunConfig& config) {
  const fs::path file = config.metrics.jsonl;
  const std::string where = output_where(config, "metrics", "jsonl") + file.string();
  // Made now, as the checkpoints' directory is: a path that cannot hold the file is found
  // before the model loads.
  std::error_code error;
  if (const fs::path parent = fs::absolute(file).parent_path(); !fs::is_directory(parent)) {
    fs::create_directories(parent, error);
    if (error) throw UserError(where + ": cannot make its directory " + parent.string() + ": " + error.message());
  }
  if (!fs::is_regular_file(fs::status(file, error))) return;
  std::ifstream in(file);
  std::string first;
  std::getline(in, first);
  const auto record = json::parse(first, nullptr, /*allow_exceptions=*/false);
  if (fs::file_size(file, error) > 0 && !(record.is_object() && record.contains("step"))) {
    throw UserError(where + ": holds something other than a run's metrics, which the run would overwrite; "
                    "choose another file");
  }
}

}  // namespace

void check_outputs(const RunConfig& config) {
  if (config.checkpoint.save_final) {
    check_export_dir(config);
    check_adapter_dir(config);
  }
  check_metrics_file(config);
  make_writable_dir(config, "metrics", "tensorboard", config.metrics.tensorboard);
  const CheckpointConfig& saves = config.checkpoint;
  if (saves.save_every > 0 || saves.save_final || saves.save_on_signal) {
    make_writable_dir(config, "checkpoint", "dir", config.checkpoint.dir);
  }
}

namespace {

// `path`, or the nearest directory above it that exists: where its files will land.
fs::path existing_part(const fs::path& path) {
  fs::path at = fs::absolute(path).lexically_normal();
  while (!fs::exists(at) && at.has_parent_path() && at != at.parent_path()) at = at.parent_path();
  return at;
}

// "195 kB", "19.5 MB", "1.23 GB": three figures, in the largest unit that keeps them above 1.
std::string bytes_text(uint64_t bytes) {
  const auto [scale, unit] = bytes >= 1'000'000'000 ? std::pair(1e9, " GB")
                             : bytes >= 1'000'000   ? std::pair(1e6, " MB")
                                                    : std::pair(1e3, " kB");
  std::ostringstream text;
  text.precision(3);
  text << static_cast<double>(bytes) / scale << unit;
  return text.str();
}

}  // namespace

void check_room_for_outputs(const RunConfig& config, const OutputSizes& sizes) {
  const CheckpointConfig& saves = config.checkpoint;
  const fs::path checkpoints = existing_part(saves.dir);
  const uint64_t checkpoint_room = fs::space(checkpoints).available;
  // Rank 0's disk holds its node's share at the least, where each node writes to its own.
  const uint64_t one = sizes.checkpoint / static_cast<uint64_t>(std::max(sizes.nodes, 1));
  if (sizes.saves > 0 && checkpoint_room < one) {
    throw UserError(output_where(config, "checkpoint", "dir") + saves.dir + ": " + bytes_text(checkpoint_room) +
                    " free on its filesystem, and a checkpoint of this run takes " + bytes_text(one) +
                    " at the least (its trainable parameters' masters and AdamW's two moments" +
                    (sizes.nodes > 1 ? ", this node's share of " + std::to_string(sizes.nodes) + " nodes" : "") +
                    "), so its first save would fail, after the steps before it");
  }
  if (sizes.exported > 0) {
    const fs::path exported = existing_part(saves.export_dir);
    struct stat export_disk {}, checkpoint_disk {};
    // The last checkpoint is written just before the export, to the same disk where they share one.
    const bool shared = ::stat(exported.c_str(), &export_disk) == 0 &&
                        ::stat(checkpoints.c_str(), &checkpoint_disk) == 0 &&
                        export_disk.st_dev == checkpoint_disk.st_dev;
    const uint64_t needed = sizes.exported + (shared && saves.save_final ? one : 0);
    const uint64_t room = fs::space(exported).available;
    if (room < needed) {
      throw UserError(output_where(config, "checkpoint", "export_dir") + saves.export_dir + ": " + bytes_text(room) +
                      " free on its filesystem, and the export at the end takes " + bytes_text(sizes.exported) +
                      (needed > sizes.exported ? " beside the last checkpoint's " + bytes_text(one) : std::string()) +
                      ": it would fail after the training");
    }
  }
  // Rotation deletes the oldest once a new checkpoint is written, so keep + 1 are held at once.
  size_t held = 0;
  for (const auto& c : list_checkpoints(saves.dir)) held += of_this_run(config, c.path) ? 1 : 0;
  const auto most = static_cast<int64_t>(held) + sizes.saves;
  const int64_t at_once = saves.keep > 0 ? std::min(most, saves.keep + 1) : most;
  const int64_t more = at_once - static_cast<int64_t>(held);
  if (one > 0 && more > 1 && checkpoint_room / one < static_cast<uint64_t>(more)) {
    log_warn("[checkpoint] dir ", saves.dir, ": room for ", checkpoint_room / one, " more checkpoint(s) of ",
             bytes_text(one), " (", bytes_text(checkpoint_room), " free), but the run holds ", at_once,
             " at once (keep = ", saves.keep, ", and the one written before the oldest is deleted): the save ",
             "that finds no room will stop the run; lower keep or free space");
  }
}

}  // namespace fsdpp
