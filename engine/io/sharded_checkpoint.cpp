// Reading, listing and rotating sharded checkpoints. Writing is the training loop's, which
// owns the collective order; this file knows the layout and how to trust what is on disk.
#include "io/sharded_checkpoint.h"

#include "core/checksum.h"
#include "core/error.h"
#include "core/failpoint.h"
#include "core/log.h"
#include "core/mapped_file.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <set>

namespace fsdpp {

namespace fs = std::filesystem;

namespace {

constexpr const char* kPartialPrefix = ".partial-";
constexpr const char* kDeletingPrefix = ".deleting-";

std::optional<int64_t> step_of(const std::string& dir_name) {
  if (!dir_name.starts_with("step-") || dir_name.size() == 5) return std::nullopt;
  const std::string digits = dir_name.substr(5);
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) return std::nullopt;
  // A number past 64 bits names no step a run saves: another name, passed over like step-abc.
  int64_t step = 0;
  if (std::from_chars(digits.data(), digits.data() + digits.size(), step).ec != std::errc{}) return std::nullopt;
  return step;
}

// metadata.json's checksum, from metadata.crc32c: edits and corruption show before any of its
// fields is trusted.
void check_metadata_checksum(const fs::path& dir, const std::string& text) {
  const fs::path sum_path = file_in_directory(dir, kMetadataChecksumFile);
  std::ifstream in(sum_path);
  std::string recorded;
  in >> recorded;
  const std::string actual = format_crc32c(crc32c(text.data(), text.size()));
  if (recorded != actual) {
    throw CorruptCheckpoint("checksum " + actual + " does not match the " + std::string(kMetadataChecksumFile) +
                                " of " + dir.string() + " (the file is corrupt or was edited)",
                            dir);
  }
}

uintmax_t directory_bytes(const fs::path& dir) {
  uintmax_t total = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) total += e.file_size();
  }
  return total;
}

}  // namespace

std::string rank_file_name(int rank) {
  char name[40];
  std::snprintf(name, sizeof name, "rank-%05d.safetensors", rank);
  return name;
}

fs::path checkpoint_path(const fs::path& root, int64_t step) {
  char name[40];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return root / name;
}

fs::path staging_path(const fs::path& root, int64_t step) {
  return root / (kPartialPrefix + checkpoint_path(root, step).filename().string());
}

bool ShardedCheckpoint::is_checkpoint(const fs::path& dir) {
  return fs::is_regular_file(dir / "metadata.json") && fs::exists(dir / kMetadataChecksumFile);
}

ShardedCheckpoint ShardedCheckpoint::open(const fs::path& dir) {
  if (!fs::is_directory(dir)) throw UserError(dir.string() + ": no such checkpoint directory");
  const fs::path meta_path = dir / "metadata.json";
  if (!fs::is_regular_file(meta_path)) {
    throw UserError(meta_path.string() + ": missing; " + dir.string() + " is not a complete checkpoint");
  }
  ShardedCheckpoint c;
  c.dir_ = dir;
  c.opened_ = std::make_shared<std::map<std::string, std::shared_ptr<SafetensorsFile>>>();
  c.verified_ = std::make_shared<std::set<std::string>>();
  c.stats_ = std::make_shared<ReadStats>();
  try {
    const std::string text = read_text_file(meta_path);
    check_metadata_checksum(dir, text);
    c.meta_ = CheckpointMetadata::parse(text);
    for (const auto& [name, f] : c.meta_.files) {
      const fs::path path = file_in_directory(dir, name);
      if (fs::file_size(path) != f.bytes) {
        throw UserError("records " + std::to_string(f.bytes) + " bytes for " + path.string() + ", which has " +
                        std::to_string(fs::file_size(path)) + " (truncated or overwritten)");
      }
    }
  } catch (const UserError& e) {
    throw UserError(meta_path.string() + ": " + e.what());
  }
  // A run finds its checkpoints by their names: one renamed would be taken for a step it is not.
  fs::path name = fs::absolute(dir).lexically_normal();
  if (!name.has_filename()) name = name.parent_path();  // "step-N/" or "step-N/."
  const auto named = step_of(name.filename().string());
  if (named && *named != c.meta_.step) {
    throw UserError(dir.string() + ": is named step " + std::to_string(*named) + " but holds step " +
                    std::to_string(c.meta_.step) + " (renamed?); give it its own name, " +
                    checkpoint_path("", c.meta_.step).string());
  }
  return c;
}

const TensorRecord& ShardedCheckpoint::record(const std::string& key) const {
  auto it = meta_.tensors.find(key);
  if (it == meta_.tensors.end()) throw UserError(dir_.string() + ": checkpoint has no tensor '" + key + "'");
  return it->second;
}

std::vector<std::string> ShardedCheckpoint::keys(const std::string& prefix) const {
  std::vector<std::string> out;
  for (const auto& [key, r] : meta_.tensors) {
    if (key.starts_with(prefix)) out.push_back(key);
  }
  return out;
}

fs::path ShardedCheckpoint::verified(const std::string& name) const {
  const fs::path path = dir_ / name;
  if (verified_->count(name)) return path;
  auto it = meta_.files.find(name);
  if (it == meta_.files.end()) throw UserError(dir_.string() + ": checkpoint lists no file " + name);
  const auto& [bytes, checksum] = it->second;
  const auto mapped = MappedFile::open(path);
  const std::string actual = format_crc32c(crc32c(mapped->data(), mapped->size()));
  if (mapped->size() != bytes || actual != checksum) {
    throw CorruptCheckpoint(path.string() + ": checksum " + actual + " does not match the recorded " + checksum +
                            " (the file is corrupt)", dir_);
  }
  verified_->insert(name);
  return path;
}

const SafetensorsFile& ShardedCheckpoint::file(const std::string& name) const {
  auto& slot = (*opened_)[name];
  if (!slot) slot = SafetensorsFile::open(verified(name));
  return *slot;
}

void ShardedCheckpoint::read_rows(const std::string& key, at::Tensor& rows, int64_t first_row) const {
  const TensorRecord& r = record(key);
  const int64_t count = rows.dim() == 0 ? 1 : rows.size(0);
  TORCH_CHECK(first_row >= 0 && first_row + count <= row_count(r.shape), "rows out of range for ", key);
  if (count == 0) return;
  const auto start = std::chrono::steady_clock::now();
  at::NoGradGuard no_grad;
  at::Tensor out = rows.view({count, -1});
  for (const auto& s : r.shards) {
    const int64_t lo = std::max(first_row, s.first_row);
    const int64_t hi = std::min(first_row + count, s.first_row + s.rows);
    if (lo >= hi) continue;
    const SafetensorsFile& f = file(s.file);
    at::Tensor stored = f.tensor(key);
    std::vector<int64_t> expected = r.shape.empty() ? std::vector<int64_t>{1} : r.shape;
    expected[0] = s.rows;
    if (stored.sizes().vec() != expected || stored.scalar_type() != r.dtype) {
      throw UserError(f.path().string() + ": tensor '" + key + "' is " + safetensors_dtype_name(stored.scalar_type()) +
                      " " + c10::str(stored.sizes()) + " but the metadata records " + safetensors_dtype_name(r.dtype) +
                      " " + c10::str(c10::IntArrayRef(expected)));
    }
    out.narrow(0, lo - first_row, hi - lo).copy_(stored.view({s.rows, -1}).narrow(0, lo - s.first_row, hi - lo));
  }
  stats_->bytes += static_cast<size_t>(rows.numel()) * c10::elementSize(r.dtype);
  stats_->seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

at::Tensor ShardedCheckpoint::read_full(const std::string& key) const {
  const TensorRecord& r = record(key);
  at::Tensor full = at::empty(r.shape, at::TensorOptions().dtype(r.dtype));
  read_rows(key, full, 0);
  return full;
}

at::Tensor ShardedCheckpoint::read_whole(const std::string& file_name, const std::string& key) const {
  if (!lists_file(file_name)) return {};
  const SafetensorsFile& f = file(file_name);
  return f.contains(key) ? f.tensor(key).clone() : at::Tensor();
}

void ShardedCheckpoint::verify_rows(const std::string& key, int64_t first_row, int64_t count) const {
  for (const auto& s : record(key).shards) {
    if (std::max(first_row, s.first_row) < std::min(first_row + count, s.first_row + s.rows)) verified(s.file);
  }
}

std::vector<CheckpointEntry> list_checkpoints(const fs::path& root) {
  std::vector<CheckpointEntry> out;
  if (!fs::is_directory(root)) return out;
  for (const auto& e : fs::directory_iterator(root)) {
    const auto step = step_of(e.path().filename().string());
    if (step && e.is_directory() && fs::is_regular_file(e.path() / "metadata.json")) {
      out.push_back({*step, e.path(), directory_bytes(e.path())});
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  return out;
}

void check_complete_checkpoints(const fs::path& root) {
  std::error_code error;
  for (fs::directory_iterator it(root, error), end; !error && it != end; it.increment(error)) {
    const fs::path& path = it->path();
    if (!step_of(path.filename().string())) continue;
    const bool directory = fs::is_directory(path, error);
    if (!directory || !fs::is_regular_file(path / "metadata.json", error)) {
      throw UserError(path.string() + ": named as a checkpoint, but " +
                      (directory ? "it holds no metadata.json" : "it is not a directory") +
                      ", so it is not a complete one (a save lands whole); move it out of [checkpoint] dir");
    }
  }
}

std::optional<CheckpointEntry> latest_checkpoint(const fs::path& root) {
  auto all = list_checkpoints(root);
  if (all.empty()) return std::nullopt;
  return all.back();
}

void clear_partial_checkpoints(const fs::path& root) {
  if (!fs::is_directory(root)) return;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with(kPartialPrefix) && !name.starts_with(kDeletingPrefix)) continue;
    try {
      remove_tree(e.path());
    } catch (const UserError& error) {  // leftovers that cannot go cost disk space, not the run
      log_warn("checkpoint: ", error.what());
    }
  }
}

std::vector<fs::path> rotate_checkpoints(const fs::path& root, int64_t keep, uintmax_t max_bytes,
                                         const std::function<bool(const CheckpointEntry&)>& ours) {
  auto all = list_checkpoints(root);
  std::erase_if(all, [&](const CheckpointEntry& c) { return !ours(c); });
  uintmax_t total = 0;
  for (const auto& c : all) total += c.bytes;
  std::vector<fs::path> removed;
  size_t first_kept = 0;
  while (all.size() - first_kept > 1) {
    const bool over_count = keep > 0 && all.size() - first_kept > static_cast<size_t>(keep);
    const bool over_size = max_bytes > 0 && total > max_bytes;
    if (!over_count && !over_size) break;
    const CheckpointEntry& old = all[first_kept++];
    const fs::path doomed = root / (kDeletingPrefix + old.path.filename().string());
    // The checkpoint just saved is complete: an older one that cannot go (a file made
    // immutable, a directory of another owner) costs disk space, not the run.
    try {
      fs::rename(old.path, doomed);
    } catch (const std::exception& e) {
      log_warn("checkpoint: ", old.path.string(), " stays, since it could not be renamed for removal (", e.what(),
               "); [checkpoint] keep and max_gb are exceeded until it is");
      break;
    }
    // Renamed, it is no checkpoint of the run any more: what cannot be deleted of it now, the
    // next save's clean-up tries again.
    total -= old.bytes;
    try {
      failpoint_error("checkpoint-rotate-error");
      remove_tree(doomed);
      removed.push_back(old.path);
    } catch (const UserError& e) {
      log_warn("checkpoint: ", old.path.string(), " is not all removed yet: ", e.what());
    }
  }
  return removed;
}

}  // namespace fsdpp
