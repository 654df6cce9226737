// metadata.json of a sharded checkpoint, parsed and validated from its text alone: every
// tensor's global dtype and shape with each shard's file and rows, each file's size and
// checksum, the step, the world size and the training state's counters. What needs the
// directory (the files' presence, sizes and checksums) is ShardedCheckpoint::open's.
#pragma once

#include <c10/core/ScalarType.h>
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fsdpp {

inline constexpr const char* kCheckpointFormat = "fsdpp-sharded-checkpoint";
// The largest world a checkpoint may record.
inline constexpr int64_t kMaxWorldSize = int64_t{1} << 20;

struct ShardRecord {
  std::string file;
  int64_t first_row = 0;
  int64_t rows = 0;
};

struct TensorRecord {
  at::ScalarType dtype;
  std::vector<int64_t> shape;        // the full tensor's
  std::vector<ShardRecord> shards;   // by first_row, covering every row once
};

struct FileRecord {
  uint64_t bytes = 0;
  std::string checksum;  // CRC-32C as format_crc32c writes it
};

struct CheckpointMetadata {
  int64_t step = 0;
  int world_size = 1;
  std::map<std::string, FileRecord> files;      // by name inside the checkpoint directory
  std::map<std::string, TensorRecord> tensors;  // by key ("model/...", "exp_avg/...")
  std::shared_ptr<const nlohmann::json> document;  // the whole file, for the training state

  // UserError naming the field for text that is not JSON, not of this format or version, or
  // holds a field missing, of the wrong type or out of range (shards that do not tile their
  // tensor's rows, a shard in a file the metadata does not list). The caller prefixes the
  // file's path.
  static CheckpointMetadata parse(const std::string& text);
};

// Rows of a tensor of `shape` as checkpoints shard it: dimension 0, or 1 for a scalar.
int64_t row_count(const std::vector<int64_t>& shape);

}  // namespace fsdpp
