// Claiming a run's output directory, and finding its own checkpoints there.
#include "run/out_dir.h"

#include "core/error.h"
#include "core/name_list.h"
#include "core/json_text.h"
#include "core/log.h"
#include "core/mapped_file.h"
#include "io/sharded_checkpoint.h"
#include "run/run_checkpoint.h"
#include "run/shared_checkpoints.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <vector>

namespace fsdpp {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kIdentityFile = "run.json";

std::optional<RunIdentity> recorded_identity(const fs::path& out_dir) {
  const fs::path file = out_dir / kIdentityFile;
  if (!fs::is_regular_file(file)) return std::nullopt;
  try {
    const json j = parse_json(read_text_file(file), file.string());
    return RunIdentity{j.at("model").get<std::string>(), j.at("data").get<std::string>(),
                       j.at("config_hash").get<std::string>(),
                       j.value("settings", json::object()).get<std::map<std::string, std::string>>()};
  } catch (const std::exception&) {  // not JSON, or not a run's fields
    throw UserError(file.string() + ": not the record of a run (delete it, or choose another [train] out_dir)");
  }
}

void record_identity(const fs::path& out_dir, const RunIdentity& run) {
  fs::create_directories(out_dir);
  const std::string text =
      json{{"model", run.model}, {"data", run.data}, {"config_hash", run.config_hash}, {"settings", run.settings}}
          .dump(1) + "\n";
  write_file_atomically(out_dir / kIdentityFile, text.data(), text.size());
}

// What a checkpoint's metadata says of the run that wrote it: the hash of its settings and
// its out_dir; "" for what it will not say.
struct Writer {
  std::string config_hash, out_dir;
};
Writer writer_of(const fs::path& checkpoint) {
  try {
    const auto meta = parse_json(read_text_file(checkpoint / "metadata.json"), "");
    return {meta.value("config_hash", ""), meta.value("run", nlohmann::json::object()).value("out_dir", "")};
  } catch (const std::exception&) {
    return {};
  }
}

}  // namespace

RunIdentity RunIdentity::of(const RunConfig& config) {
  return {fs::absolute(config.model.path).lexically_normal().string(),
          config.data.train.empty() ? "" : fs::absolute(config.data.train).lexically_normal().string(),
          fsdpp::config_hash(config), run_settings(config)};
}

namespace {

// The out_dir's record against this run: another model's or data's run there is refused, and
// so is one of other settings that this run would start afresh beside.
void check_recorded_run(const RunConfig& config, const std::string& elsewhere) {
  const RunIdentity mine = RunIdentity::of(config);
  const fs::path out_dir = config.train.out_dir;
  const auto recorded = recorded_identity(out_dir);
  if (!recorded) return;
  // A run fed rows by its caller (the Python API) reads no data file: it may go on from a run
  // that read one, and that run from it.
  const auto data_of = [](const RunIdentity& run) { return run.data.empty() ? std::string("its caller's") : run.data; };
  if (recorded->model != mine.model || (!recorded->data.empty() && !mine.data.empty() && recorded->data != mine.data)) {
    throw UserError(out_dir.string() + ": holds another run (model " + recorded->model + ", data " + data_of(*recorded) +
                    "; this run's: model " + mine.model + ", data " + data_of(mine) + "): " + elsewhere);
  }
  // Resumed, the run goes on with the settings it is given; started afresh, it would mix
  // its files with those of the run before. (A record without settings predates them.)
  const bool fresh = config.checkpoint.resume.kind == ResumeFrom::Kind::fresh;
  if (fresh && recorded->config_hash != mine.config_hash && !recorded->settings.empty()) {
    throw UserError(out_dir.string() + ": holds a run of this model and data with other settings (" +
                    settings_change(recorded->settings, mine.settings) + "): resume it ([checkpoint] resume = "
                    "\"latest\"), or " + elsewhere);
  }
}

}  // namespace

void check_out_dir(const RunConfig& config) {
  const std::string elsewhere = "choose another [train] out_dir, or set [train] reuse_out_dir = true to train beside it";
  const auto checkpoints = list_checkpoints(config.checkpoint.dir);
  if (config.train.reuse_out_dir) return check_shared_checkpoints(config, checkpoints);
  check_recorded_run(config, elsewhere);
  if (checkpoints.empty()) return;
  // A [checkpoint] dir outside out_dir may hold other runs' checkpoints (of_this_run).
  const bool others = std::any_of(checkpoints.begin(), checkpoints.end(),
                                  [&](const auto& c) { return !of_this_run(config, c.path); });
  if (others || config.checkpoint.resume.kind == ResumeFrom::Kind::fresh) {
    throw UserError(config.checkpoint.dir + ": holds the checkpoints of " + (others ? "another run" : "this run") +
                    " (up to step " + std::to_string(checkpoints.back().step) + "); " +
                    (others ? elsewhere : "resume it ([checkpoint] resume = \"latest\"), or " + elsewhere));
  }
}

std::string settings_change(const std::map<std::string, std::string>& before,
                            const std::map<std::string, std::string>& after) {
  if (before.empty()) return "settings not recorded";
  constexpr size_t kNamed = 6;
  std::vector<std::string> changes;
  const auto shown = [](const std::map<std::string, std::string>& settings, const std::string& key) {
    auto it = settings.find(key);
    return it == settings.end() ? std::string("(unset)") : it->second;
  };
  std::set<std::string> keys;
  for (const auto* settings : {&before, &after}) {
    for (const auto& [key, value] : *settings) keys.insert(key);
  }
  for (const std::string& key : keys) {
    if (shown(before, key) != shown(after, key)) changes.push_back(key + " " + shown(before, key) + " -> " + shown(after, key));
  }
  return changes.empty() ? "the same settings" : first_names(changes, kNamed);
}

namespace {

// The locks this process holds, by directory: its Runs into one out_dir (the Python API's
// several, a notebook's rebuilt one) share one, released when the last of them ends.
struct HeldLock {
  int fd = -1;
  int runs = 0;
};
std::mutex held_mutex;
std::map<std::string, HeldLock>& held_locks() {
  static std::map<std::string, HeldLock> held;
  return held;
}

}  // namespace

std::unique_ptr<OutDirLock> OutDirLock::claim(const RunConfig& config) {
  // A run that reads no [data] (the Python API's: its loop brings the rows and says when to
  // save) beside other runs takes none: a loop's processes may hold runs of one file at once.
  if (config.train.reuse_out_dir && config.data.train.empty()) return nullptr;
  const fs::path dir = config.train.out_dir;
  std::error_code error;
  fs::create_directories(dir, error);
  if (error) throw UserError(dir.string() + ": cannot create [train] out_dir: " + error.message());
  // Beside other runs, the lock is of this run's settings alone: a second run of the same ones
  // would share its checkpoints and metrics files.
  const std::string name = config.train.reuse_out_dir ? ".lock" + settings_suffix(config) : ".lock";
  const std::string key = (fs::canonical(dir, error) / name).string();
  std::lock_guard lock(held_mutex);
  if (auto it = held_locks().find(key); it != held_locks().end()) {
    ++it->second.runs;
    return std::unique_ptr<OutDirLock>(new OutDirLock(key));
  }
  const fs::path file = dir / name;
  // Read-only where another user made it: a lock needs no write access, only the note does.
  int fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0 && errno == EACCES) fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw UserError(file.string() + ": cannot open: " + std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int why = errno;
    char holder[32] = {};
    const ssize_t got = why == EWOULDBLOCK ? ::pread(fd, holder, sizeof holder - 1, 0) : 0;
    ::close(fd);
    // A file system that cannot lock (some network mounts) goes unlocked.
    if (why != EWOULDBLOCK) return nullptr;
    const std::string pid(holder, got > 0 ? static_cast<size_t>(got) : 0);
    throw UserError(dir.string() + ": another run " + (config.train.reuse_out_dir ? "of these settings " : "") +
                    "is training in this [train] out_dir" + (pid.empty() ? "" : " (process " + pid + ")") +
                    "; wait for it to end, or choose another out_dir");
  }
  // The holder's process id, for the refusal above (the lock holds without it). One left by
  // a run that ended is overwritten here: its lock died with its process.
  const std::string pid = std::to_string(::getpid());
  [[maybe_unused]] const bool noted =
      ::ftruncate(fd, 0) == 0 && ::pwrite(fd, pid.data(), pid.size(), 0) == static_cast<ssize_t>(pid.size());
  held_locks()[key] = {fd, 1};
  return std::unique_ptr<OutDirLock>(new OutDirLock(key));
}

OutDirLock::~OutDirLock() {
  std::lock_guard lock(held_mutex);
  auto it = held_locks().find(key_);
  if (it == held_locks().end() || --it->second.runs > 0) return;
  ::close(it->second.fd);
  held_locks().erase(it);
}

void record_run(const RunConfig& config) {
  // Beside other runs, the directory's record stays the run's that made it.
  if (config.train.reuse_out_dir && fs::exists(fs::path(config.train.out_dir) / kIdentityFile)) return;
  RunIdentity mine = RunIdentity::of(config);
  const auto recorded = config.train.reuse_out_dir ? std::nullopt : recorded_identity(config.train.out_dir);
  // A run fed by its caller keeps the data the record names, so that a run of other data is
  // still refused the out_dir after it.
  if (recorded && mine.data.empty()) mine.data = recorded->data;
  if (recorded && recorded->config_hash != mine.config_hash && !recorded->settings.empty()) {
    log_warn(config.train.out_dir, ": the run goes on with other settings than it had: ",
             settings_change(recorded->settings, mine.settings));
  }
  record_identity(config.train.out_dir, mine);
}

bool of_this_run(const RunConfig& config, const fs::path& checkpoint) {
  const fs::path own = config.checkpoint.dir;
  const bool in_own_dir = !config.train.reuse_out_dir && path_within(own, config.train.out_dir) &&
                          fs::weakly_canonical(checkpoint.parent_path()) == fs::weakly_canonical(own);
  if (in_own_dir) return true;
  const Writer writer = writer_of(checkpoint);
  // An out_dir holds one run unless runs share it by choice, whatever its settings now.
  const bool own_out_dir = !config.train.reuse_out_dir && !config.train.out_dir.empty() &&
                           writer.out_dir == canonical_out_dir(config);
  return own_out_dir || writer.config_hash == config_hash(config);
}

bool in_own_run_dir(const RunConfig& config, const std::string& output) {
  return !config.train.reuse_out_dir && !config.train.out_dir.empty() &&
         fs::exists(fs::path(config.train.out_dir) / kIdentityFile) && path_within(output, config.train.out_dir);
}

std::string canonical_out_dir(const RunConfig& config) {
  return config.train.out_dir.empty() ? "" : fs::weakly_canonical(fs::absolute(config.train.out_dir)).string();
}

std::optional<fs::path> latest_of_this_run(const RunConfig& config) {
  return later_of_this_run(config, config.checkpoint.dir, -1);
}

std::optional<fs::path> later_of_this_run(const RunConfig& config, const fs::path& root, int64_t step) {
  const auto checkpoints = list_checkpoints(root);
  for (auto it = checkpoints.rbegin(); it != checkpoints.rend() && it->step > step; ++it) {
    if (of_this_run(config, it->path)) return it->path;
  }
  return std::nullopt;
}

}  // namespace fsdpp
