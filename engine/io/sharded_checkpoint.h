// Sharded checkpoints on disk. A checkpoint is a directory <root>/step-00000100 holding one
// safetensors file per rank (that rank's rows of each tensor), the model's config.json, and
// metadata.json: every tensor's global shape and dtype with each shard's file and rows, the
// mesh, the world size, the step, the training state and a CRC-32C per file; metadata.crc32c
// holds metadata.json's own CRC-32C. Files are named plainly inside the directory: a name
// that leaves it, or a link, is refused. It is written
// as <root>/.partial-step-00000100 and renamed into place once complete, so a directory
// named step-N is complete by construction and a crash mid-save leaves earlier ones intact.
#pragma once

#include "core/error.h"
#include "io/checkpoint_metadata.h"
#include "io/safetensors.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace fsdpp {

inline constexpr const char* kMetadataChecksumFile = "metadata.crc32c";

// A checkpoint file whose bytes are not those its metadata records (or metadata not its
// checksum's): the checkpoint `dir` is damaged, whichever file of it was read first.
class CorruptCheckpoint : public UserError {
 public:
  CorruptCheckpoint(const std::string& message, std::filesystem::path dir)
      : UserError(message), dir_(std::move(dir)) {}
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
};

// Tensor bytes read from a checkpoint and the seconds spent reading them (checksum
// verification included).
struct ReadStats {
  size_t bytes = 0;
  double seconds = 0.0;
};

// An opened checkpoint: metadata parsed and validated; each file's size checked on open and
// its checksum verified the first time any of its rows is read.
class ShardedCheckpoint {
 public:
  // UserError naming the file (and field) when the directory, its metadata or a file it
  // lists is missing, malformed, out of range, outside the directory or of the wrong size.
  static ShardedCheckpoint open(const std::filesystem::path& dir);
  // Whether `dir` holds a checkpoint, complete or not: a metadata.json with its checksum
  // file, which no HF directory has. Its contents are not judged here: open() says what is
  // wrong with them, rather than letting the directory pass for another kind.
  static bool is_checkpoint(const std::filesystem::path& dir);

  const std::filesystem::path& dir() const { return dir_; }
  const nlohmann::json& metadata() const { return *meta_.document; }
  int64_t step() const { return meta_.step; }
  int world_size() const { return meta_.world_size; }
  bool contains(const std::string& key) const { return meta_.tensors.count(key) != 0; }
  bool lists_file(const std::string& name) const { return meta_.files.count(name) != 0; }
  const TensorRecord& record(const std::string& key) const;
  // Keys that start with `prefix`, in order.
  std::vector<std::string> keys(const std::string& prefix) const;

  // Copies rows [first_row, first_row + rows.size(0)) of tensor `key` into `rows`
  // (converting dtype), reading only the shards that hold them.
  void read_rows(const std::string& key, at::Tensor& rows, int64_t first_row) const;
  at::Tensor read_full(const std::string& key) const;
  // A tensor stored whole in one file (per-rank state such as RNG), or an undefined tensor.
  at::Tensor read_whole(const std::string& file, const std::string& key) const;
  // Verifies now the checksum of each file read_rows(key, ..., first_row) of `count` rows
  // would read, so that a caller can refuse a corrupt checkpoint before it copies any row.
  void verify_rows(const std::string& key, int64_t first_row, int64_t count) const;
  ReadStats read_stats() const { return *stats_; }
  // The path of file `name` of the checkpoint, its checksum verified.
  std::filesystem::path verified(const std::string& name) const;

 private:
  const SafetensorsFile& file(const std::string& name) const;

  std::filesystem::path dir_;
  CheckpointMetadata meta_;
  std::shared_ptr<std::map<std::string, std::shared_ptr<SafetensorsFile>>> opened_;
  std::shared_ptr<std::set<std::string>> verified_;
  std::shared_ptr<ReadStats> stats_;
};

// The file each rank writes.
std::string rank_file_name(int rank);
std::filesystem::path checkpoint_path(const std::filesystem::path& root, int64_t step);
std::filesystem::path staging_path(const std::filesystem::path& root, int64_t step);

struct CheckpointEntry {
  int64_t step = 0;
  std::filesystem::path path;
  uintmax_t bytes = 0;
};

// The complete checkpoints under `root` (directories step-N with a metadata.json), oldest
// first; a missing root has none.
std::vector<CheckpointEntry> list_checkpoints(const std::filesystem::path& root);
// UserError for a step-N under `root` that is not a complete checkpoint. A save lands whole
// by a rename, so such a one was damaged or put there: passed over at start, a resume would
// begin from an older step (or none), and the next save of step N would be skipped. Runs
// check at start only: mid-run, a neighbour's rotation may rename entries as they are listed.
void check_complete_checkpoints(const std::filesystem::path& root);
std::optional<CheckpointEntry> latest_checkpoint(const std::filesystem::path& root);

// Among the complete checkpoints `ours` accepts (a run's own, where others share the
// directory), deletes the oldest beyond the newest `keep` (0: no limit) and while they
// together exceed `max_bytes` (0: no limit), never the newest one; each goes by a rename
// first, so a crash mid-delete never leaves a torn directory named step-N. One that cannot
// be renamed is a warning that ends the rotation; one renamed whose files cannot all be
// deleted, a warning, left to the next save's clean-up. Returns the paths deleted whole.
std::vector<std::filesystem::path> rotate_checkpoints(const std::filesystem::path& root, int64_t keep,
                                                      uintmax_t max_bytes,
                                                      const std::function<bool(const CheckpointEntry&)>& ours);

// Removes leftovers of interrupted saves and deletes (.partial-*, .deleting-*) under root.
void clear_partial_checkpoints(const std::filesystem::path& root);

}  // namespace fsdpp
