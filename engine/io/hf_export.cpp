// The export's directory: its target checked, its files staged beside it, then swapped in.
#include "io/hf_export.h"

#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
#include "core/mapped_file.h"
#include "models/registry.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>

namespace fsdpp {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// What an export copies beside the weights from the model it came from: the tokenizer and
// how the model generates, as transformers loads them.
constexpr const char* kCompanionFiles[] = {"tokenizer.json",      "tokenizer_config.json", "special_tokens_map.json",
                                           "added_tokens.json",   "tokenizer.model",       "vocab.json",
                                           "merges.txt",          "chat_template.jinja",   "chat_template.json",
                                           "generation_config.json",
                                           // A vision-language model's processors: its images' and videos'.
                                           "preprocessor_config.json", "video_preprocessor_config.json",
                                           "processor_config.json"};

// Marks a staging directory as an export's while it is written, so that a later export
// removes only what an interrupted export left, never a directory of the user's of that name.
constexpr const char* kStagingMark = ".fsdpp-export-staging";

// What an export's safetensors files carry in their metadata, beside transformers' "format":
// a directory whose weights lack it is a model no export wrote, which an export never replaces.
const std::map<std::string, std::string> kExportMetadata = {{"format", "pt"}, {"written_by", "fsdpp export"}};

// The weights file of the model in `dir` (model.safetensors, or the first of its shards);
// empty where there is none.
fs::path weights_file_in(const fs::path& dir) {
  if (fs::is_regular_file(dir / "model.safetensors")) return dir / "model.safetensors";
  std::vector<fs::path> shards;
  std::error_code error;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (name.starts_with("model-") && name.ends_with(".safetensors")) shards.push_back(it->path());
  }
  return shards.empty() ? fs::path() : *std::min_element(shards.begin(), shards.end());
}

// Whether an export writes a file named `name`.
bool written_by_export(const std::string& name) {
  if (name == "config.json" || name == "model.safetensors" || name == "model.safetensors.index.json") return true;
  if (name.starts_with("model-") && name.ends_with(".safetensors")) return true;  // a shard
  return std::find(std::begin(kCompanionFiles), std::end(kCompanionFiles), name) != std::end(kCompanionFiles);
}

// Whether `weights` (a safetensors file; empty: none) says an export wrote it.
bool bears_export_mark(const fs::path& weights) {
  if (weights.empty()) return false;
  const auto mark = SafetensorsFile::open(weights)->metadata();
  return mark.count("written_by") > 0 && mark.at("written_by") == kExportMetadata.at("written_by");
}

// `dir` through its links, or as written where they do not resolve (check_export_target
// then says why).
fs::path resolved_links(const fs::path& dir) {
  std::error_code error;
  fs::path path = fs::weakly_canonical(fs::absolute(dir), error);
  if (error) path = fs::absolute(dir).lexically_normal();
  // "out/" names the directory "out", beside which its staging directory is made.
  if (!path.has_filename() && path.has_relative_path()) path = path.parent_path();
  return path;
}

// Whether `path` holds nothing, or what an interrupted export left there (its staging
// directory, or the old export it had moved aside); UserError for anything else.
bool holds_leftover(const fs::path& path, const fs::path& export_dir) {
  std::error_code error;
  const fs::file_status status = fs::symlink_status(path, error);
  if (!fs::exists(status)) return false;
  // The mark first: an interrupted export's weights may be half written, and a directory of
  // weights without a header to read is as much in the way as one of another's.
  if (fs::is_directory(status)) {
    if (fs::exists(path / kStagingMark)) return true;
    try {
      if (bears_export_mark(weights_file_in(path))) return true;
    } catch (const UserError&) {
      // unreadable weights: not an export's
    }
  }
  throw UserError(path.string() + ": is in the way of the export to " + export_dir.string() +
                  ", which works beside it under that name, and is not an export's; move it or remove it");
}

void clear_leftover(const fs::path& path, const fs::path& export_dir) {
  if (holds_leftover(path, export_dir)) remove_tree(path);
}

}  // namespace

void check_export_target(const fs::path& dir, bool in_own_run_dir) {
  std::error_code error;
  if (fs::is_symlink(fs::symlink_status(dir, error)) && !fs::exists(fs::status(dir, error))) {
    std::error_code unread;
    throw UserError(dir.string() + ": is a link to " + fs::read_symlink(dir, unread).string() +
                    (error && error != std::errc::no_such_file_or_directory ? " (" + error.message() + ")"
                                                                             : ", which does not exist") +
                    "; an export writes through a link only to a directory");
  }
  check_replaceable_dir(dir, "an export", written_by_export);
  // The names beside it the export works under, found now rather than after the training.
  const fs::path target = resolved_links(dir);
  for (const char* prefix : {".partial-", ".replaced-"}) {
    holds_leftover(target.parent_path() / (prefix + target.filename().string()), target);
  }
  if (!fs::is_directory(dir) || fs::is_empty(dir)) return;
  const fs::path weights = weights_file_in(dir);
  const std::string refusal = dir.string() + ": holds a model that no export wrote (";
  const std::string choose = "); an export replaces only an empty directory or an earlier export: choose another directory";
  if (weights.empty()) throw UserError(refusal + "it has no model.safetensors" + choose);
  if (in_own_run_dir) return;
  if (!bears_export_mark(weights)) throw UserError(refusal + weights.filename().string() + " bears no export's mark" + choose);
}

HfDirWriter::HfDirWriter(const ModelConfig& model_config, const std::vector<TensorSpec>& specs, const fs::path& dir,
                         at::ScalarType dtype, size_t max_shard_bytes, const fs::path& source,
                         bool in_own_run_dir)
    // Through links: a link to a directory keeps naming the new export, whose staging
    // directory is made beside the real one, on its file system, where the swap can happen.
    : dir_(resolved_links(dir)),
      staging_(dir_.parent_path() / (".partial-" + dir_.filename().string())) {
  check_export_target(dir_, in_own_run_dir);
  std::error_code error;
  if (!source.empty() && fs::equivalent(source, dir_, error)) {
    throw UserError(dir_.string() + ": is the model this export comes from; an export never replaces it: choose "
                    "another directory");
  }
  std::error_code made;
  fs::create_directories(dir_.parent_path(), made);
  if (made || !fs::is_directory(dir_.parent_path())) {
    throw UserError(dir_.string() + ": cannot make the directory it lies in (" +
                    (made ? made.message() : std::string("not a directory")) + ")");
  }
  clear_leftover(staging_, dir_);
  fs::create_directories(staging_);
  write_file_atomically(staging_ / kStagingMark, "", 0);
  json config = model_config.raw ? *model_config.raw : json::object();
  // A model made from a config.json written by hand may name no class (no key, null or []);
  // serving engines (vLLM) pick the model by it.
  const json named = config.value("architectures", json());
  if ((named.is_null() || named.empty()) && !model_config.model_type.empty()) {
    config["architectures"] = {architecture_of(model_config)};
  }
  // transformers 5 names it dtype; readers before 4.56 know torch_dtype alone.
  config["dtype"] = config["torch_dtype"] = dtype_name(dtype);
  const std::string config_text = config.dump(2) + "\n";
  write_file_atomically(staging_ / "config.json", config_text.data(), config_text.size());
  // A checkpoint records the model's directory, not its files: one moved or deleted since
  // leaves an export that transformers' AutoTokenizer cannot read.
  if (!source.empty() && !fs::is_directory(source)) {
    log_warn("export: ", source.string(), ", the directory of the model's tokenizer, chat template and generation ",
             "config, is gone, so ", dir_.string(), " holds config.json and the weights alone; copy those files in ",
             "from the model's source");
  }
  for (const char* name : kCompanionFiles) {
    if (!source.empty() && fs::is_regular_file(source / name)) fs::copy_file(source / name, staging_ / name);
  }

  shards_.emplace_back();
  size_t shard_bytes = 0;
  for (const TensorSpec& spec : specs) {
    if (shard_bytes > 0 && shard_bytes + spec.bytes() > max_shard_bytes) {
      shards_.emplace_back();
      shard_bytes = 0;
    }
    shard_bytes += spec.bytes();
    shards_.back().push_back(spec);
  }
  for (size_t i = 0; i < shards_.size(); ++i) {
    char file[64];
    std::snprintf(file, sizeof file, "model-%05zu-of-%05zu.safetensors", i + 1, shards_.size());
    files_.push_back(shards_.size() == 1 ? "model.safetensors" : file);
  }
}

HfDirWriter::~HfDirWriter() = default;

void HfDirWriter::write(const std::string& name, const at::Tensor& full) {
  while (shard_ < shards_.size() && in_shard_ == shards_[shard_].size()) {
    if (writer_) writer_->commit();
    writer_.reset();
    ++shard_;
    in_shard_ = 0;
  }
  TORCH_CHECK(shard_ < shards_.size() && shards_[shard_][in_shard_].name == name, "HF writer: tensor '", name,
              "' out of order");
  if (!writer_) {
    writer_ = std::make_unique<SafetensorsWriter>(staging_ / files_[shard_], shards_[shard_],
                                                  kExportMetadata);
  }
  writer_->write(full);
  ++in_shard_;
}

void HfDirWriter::finish() {
  if (writer_) writer_->commit();
  writer_.reset();
  if (shards_.size() == 1 && shards_[0].empty()) write_safetensors(staging_ / files_[0], {}, kExportMetadata);
  if (shards_.size() > 1) write_index();
  fs::remove(staging_ / kStagingMark);
  fsync_directory(staging_);
  // The old export and the new trade places in one step; the old is then removed. Where the
  // file system cannot exchange, the old steps aside first.
  if (::renameat2(AT_FDCWD, staging_.c_str(), AT_FDCWD, dir_.c_str(), RENAME_EXCHANGE) != 0) {
    if (errno == EINVAL || errno == ENOTSUP) {
      const fs::path aside = dir_.parent_path() / (".replaced-" + dir_.filename().string());
      clear_leftover(aside, dir_);
      fs::rename(dir_, aside);
      fs::rename(staging_, dir_);
      remove_tree(aside);
    } else if (errno == ENOENT) {
      fs::rename(staging_, dir_);  // nothing there yet
    } else {
      throw UserError(dir_.string() + ": cannot replace it (" + std::strerror(errno) + ")");
    }
  }
  remove_tree(staging_);
  fsync_directory(dir_.parent_path());
}

void HfDirWriter::write_index() const {
  size_t total_bytes = 0;
  json index = {{"metadata", json::object()}, {"weight_map", json::object()}};
  for (size_t i = 0; i < shards_.size(); ++i) {
    for (const auto& spec : shards_[i]) {
      index["weight_map"][spec.name] = files_[i];
      total_bytes += spec.bytes();
    }
  }
  index["metadata"]["total_size"] = total_bytes;
  const std::string index_text = index.dump(2) + "\n";
  write_file_atomically(staging_ / "model.safetensors.index.json", index_text.data(), index_text.size());
}

}  // namespace fsdpp
