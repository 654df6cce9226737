// Loading and saving Hugging Face model directories.
#include "io/hf_dir.h"

#include "core/checksum.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
#include "core/mapped_file.h"
#include "core/module_tree.h"
#include "io/weight_index.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

namespace fsdpp {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Whether `path` is there, as a file or a link; a link to nothing is an error, not an absence.
bool present(const fs::path& path) {
  if (!fs::exists(fs::symlink_status(path))) return false;
  if (!fs::exists(path)) {
    throw UserError(path.string() + ": a link to " + fs::read_symlink(path).string() + ", which does not exist");
  }
  return true;
}

// Without model.safetensors or its index: UserError if weight files are there all the same.
void require_no_weight_files(const fs::path& dir) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("rank-") && entry.path().extension() == ".safetensors") {
      throw UserError(dir.string() + ": holds " + name + ", a checkpoint's rank file, but not metadata.json and " +
                      "metadata.crc32c beside it, so it is not a complete checkpoint");
    }
    if (entry.path().extension() == ".safetensors") {
      throw UserError(dir.string() + ": holds " + entry.path().filename().string() +
                      " but neither model.safetensors nor model.safetensors.index.json, which name the "
                      "model's weights (a directory of config.json alone starts from random weights)");
    }
  }
}

}  // namespace

HfWeights HfWeights::open(const fs::path& dir) {
  HfWeights weights;
  const fs::path index = dir / "model.safetensors.index.json";
  const fs::path single = dir / "model.safetensors";
  weights.dir_ = dir;
  if (present(index)) {
    std::map<std::string, std::shared_ptr<SafetensorsFile>> shards;
    for (const auto& [name, file] : parse_weight_map(read_text_file(index), index.string())) {
      auto& shard = shards[file];
      if (!shard) {
        fs::path shard_path;
        try {
          shard_path = file_in_directory(dir, file, Links::followed);
        } catch (const UserError& e) {
          throw UserError(index.string() + ": weight_map['" + name + "'] " + e.what());
        }
        shard = SafetensorsFile::open(shard_path);
      }
      if (!shard->contains(name)) {
        throw UserError(shard->path().string() + ": missing tensor '" + name + "' that the index places there");
      }
      weights.where_[name] = shard;
    }
    if (weights.where_.empty()) throw UserError(index.string() + ": its weight_map names no tensors");
  } else if (present(single)) {
    auto file = SafetensorsFile::open(single);
    for (const auto& [name, entry] : file->entries()) weights.where_[name] = file;
    if (weights.where_.empty()) throw UserError(single.string() + ": holds no tensors");
  } else {
    require_no_weight_files(dir);
  }
  return weights;
}

const SafetensorsFile& HfWeights::file_of(const std::string& name) const { return *where_.at(name); }

std::vector<std::string> HfWeights::names() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : where_) out.push_back(name);
  return out;
}

fs::path hf_config_path(const fs::path& path) {
  if (!fs::exists(path)) {
    const std::string relative =
        path.is_relative() ? " (relative to the working directory " + fs::current_path().string() + ")" : "";
    throw UserError(path.string() + ": no such model directory or config file" + relative);
  }
  return fs::is_directory(path) ? path / "config.json" : path;
}

size_t HfWeights::file_bytes() const {
  std::set<const SafetensorsFile*> seen;
  size_t total = 0;
  for (const auto& [name, file] : where_) {
    if (seen.insert(file.get()).second) total += std::filesystem::file_size(file->path());
  }
  return total;
}

size_t HfWeights::resident_bytes() const {
  std::set<const SafetensorsFile*> seen;
  size_t total = 0;
  for (const auto& [name, file] : where_) {
    if (seen.insert(file.get()).second) total += file->resident_bytes();
  }
  return total;
}

void HfWeights::advise_random() const {
  for (const auto& [name, file] : where_) file->advise_random();
}

void read_hf_rows(const HfWeights& weights, const std::vector<std::string>& names, c10::IntArrayRef full_shape,
                  at::Tensor& out, int64_t first_row) {
  auto found = std::find_if(names.begin(), names.end(), [&](const auto& n) { return weights.contains(n); });
  if (found == names.end()) {
    throw UserError(weights.dir().string() + ": no tensor '" + names.front() + "' in model.safetensors or its index");
  }
  const SafetensorsFile& file = weights.file_of(*found);
  at::Tensor source = file.tensor(*found);
  const std::string where = file.path().string() + ": tensor '" + *found + "'";
  if (source.sizes() != full_shape) {
    throw UserError(where + " has shape " + c10::str(source.sizes()) + " but the model expects " +
                    c10::str(full_shape));
  }
  if (!at::isFloatingType(source.scalar_type())) {
    throw UserError(where + " has dtype " + c10::toString(source.scalar_type()) +
                    " but the model expects a floating type");
  }
  const int64_t rows = out.dim() == 0 ? 1 : out.size(0);
  if (rows == 0) return;
  at::NoGradGuard no_grad;
  const at::Tensor flat = source.reshape({source.dim() == 0 ? 1 : source.size(0), -1});  // a view of the mapping
  out.view({rows, -1}).copy_(flat.narrow(0, first_row, rows));
}

BaseIdentity BaseIdentity::of(const std::filesystem::path& path, uint64_t init_seed) {
  BaseIdentity base{.path = std::filesystem::absolute(path)};
  auto checksum = [](const std::filesystem::path& file) {
    const auto mapped = MappedFile::open(file);
    return format_crc32c(crc32c(mapped->data(), mapped->size()));
  };
  const HfWeights weights = std::filesystem::is_directory(base.path) ? HfWeights::open(base.path) : HfWeights{};
  if (weights.empty()) {
    base.config_checksum = checksum(hf_config_path(base.path));
    base.init_seed = init_seed;
  }
  for (const auto& name : weights.names()) {
    const auto& file = weights.file_of(name).path();
    const std::string key = file.filename().string();
    if (!base.files.contains(key)) base.files[key] = checksum(file);  // a file holds many tensors
  }
  return base;
}

void BaseIdentity::check_same(const BaseIdentity& now, const std::string& where) const {
  // The same files elsewhere are the same base: the path is not compared.
  nlohmann::json there = *this, here = now;
  there.erase("path");
  here.erase("path");
  if (there == here) return;
  if (there.contains("files") != here.contains("files")) {  // one from weights, one fresh
    const auto described = [](const nlohmann::json& base) {
      return base.contains("files") ? "weights " + base["files"].dump()
                                    : "a fresh model from its config.json (seed " + base.value("init_seed", json()).dump() + ")";
    };
    throw UserError(where + ": holds the adapters of another base model than " + now.path.string() + " (" +
                    described(there) + " there, " + described(here) + " now)");
  }
  std::string differences;
  for (const auto& [key, value] : there.items()) {
    if (here.value(key, nlohmann::json()) != value) {
      differences += (differences.empty() ? "" : "; ") + key + " " + value.dump() + " there, " +
                     here.value(key, nlohmann::json()).dump() + " now";
    }
  }
  throw UserError(where + ": holds the adapters of another base model than " + now.path.string() + " (" +
                  (differences.empty() ? "its files differ" : differences) + ")");
}

// A fresh base records its config.json and seed, one with weights its files.
void to_json(nlohmann::json& j, const BaseIdentity& base) {
  j = {{"path", base.path.string()}};
  if (base.init_seed) {
    j["config.json"] = base.config_checksum;
    j["init_seed"] = *base.init_seed;
  } else {
    j["files"] = base.files;
  }
}

void from_json(const nlohmann::json& j, BaseIdentity& base) {
  base.path = j.at("path").get<std::string>();
  base.files = j.value("files", std::map<std::string, std::string>{});
  base.config_checksum = j.value("config.json", std::string());
  if (j.contains("init_seed")) base.init_seed = j.at("init_seed").get<uint64_t>();
}

void warn_unused_hf_tensors(CausalLM& model, const HfWeights& weights) {
  std::set<std::string> used;
  for (const auto& p : unique_named_parameters(model)) used.insert(p.name);
  for (const auto& group : tied_parameter_groups(model)) used.insert(group.begin(), group.end());
  for (const auto& name : weights.names()) {
    if (!used.count(name) && !name.ends_with("rotary_emb.inv_freq")) {  // RoPE tables are recomputed
      log_warn(weights.file_of(name).path().string(), ": tensor '", name, "' is not used by the model");
    }
  }
}

namespace {

// What an export copies beside the weights from the model it came from: the tokenizer and
// how the model generates, as transformers loads them.
constexpr const char* kCompanionFiles[] = {"tokenizer.json",      "tokenizer_config.json", "special_tokens_map.json",
                                           "added_tokens.json",   "tokenizer.model",       "vocab.json",
                                           "merges.txt",          "chat_template.jinja",   "chat_template.json",
                                           "generation_config.json"};

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
  if (!fs::is_directory(dir) || fs::is_empty(dir)) return;
  const fs::path weights = weights_file_in(dir);
  const std::string refusal = dir.string() + ": holds a model that no export wrote (";
  const std::string choose = "); an export replaces only an empty directory or an earlier export: choose another directory";
  if (weights.empty()) throw UserError(refusal + "it has no model.safetensors" + choose);
  if (in_own_run_dir) return;
  const auto mark = SafetensorsFile::open(weights)->metadata();
  if (mark.count("written_by") == 0 || mark.at("written_by") != kExportMetadata.at("written_by")) {
    throw UserError(refusal + weights.filename().string() + " bears no export's mark" + choose);
  }
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
  remove_tree(staging_);  // an interrupted export's
  fs::create_directories(staging_);
  json config = model_config.raw ? *model_config.raw : json::object();
  // transformers 5 names it dtype; readers before 4.56 know torch_dtype alone.
  config["dtype"] = config["torch_dtype"] = dtype_name(dtype);
  const std::string config_text = config.dump(2) + "\n";
  write_file_atomically(staging_ / "config.json", config_text.data(), config_text.size());
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
  fsync_directory(staging_);
  // The old export and the new trade places in one step; the old is then removed. Where the
  // file system cannot exchange, the old steps aside first.
  if (::renameat2(AT_FDCWD, staging_.c_str(), AT_FDCWD, dir_.c_str(), RENAME_EXCHANGE) != 0) {
    if (errno == EINVAL || errno == ENOTSUP) {
      const fs::path aside = dir_.parent_path() / (".replaced-" + dir_.filename().string());
      remove_tree(aside);
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
