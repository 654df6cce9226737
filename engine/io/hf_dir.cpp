// Loading Hugging Face model directories, and the identity of a LoRA run's base.
#include "io/hf_dir.h"

#include "core/checksum.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
#include "core/mapped_file.h"
#include "core/module_tree.h"
#include "core/name_list.h"
#include "io/weight_index.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
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

// Whether `name` is a model's weights in a format other than safetensors (PyTorch's pickles,
// TensorFlow's, Flax's, GGUF); files such as training_args.bin or optimizer.pt beside a
// model are not its weights.
bool foreign_weights(const std::string& name) {
  static const std::vector<std::string> stems = {"pytorch_model", "model", "consolidated", "tf_model", "flax_model"};
  static const std::vector<std::string> extensions = {".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf"};
  const std::string extension = fs::path(name).extension().string();
  return std::any_of(stems.begin(), stems.end(), [&](const std::string& stem) { return name.starts_with(stem); }) &&
         std::find(extensions.begin(), extensions.end(), extension) != extensions.end();
}

// Without model.safetensors or its index: UserError if weight files are there all the same, or
// other files a model's download brings beside its weights (a tokenizer, a generation config),
// which say that the weights were left out of a download or a copy. A fresh model starts from a
// directory of config.json alone, or from the path of a config.json beside other files.
void require_config_alone(const fs::path& dir) {
  std::vector<std::string> others;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (foreign_weights(name)) {
      throw UserError(dir.string() + ": holds the weights " + name + " in a format fsdpp does not read; convert them " +
                      "to safetensors (model.safetensors, or shards and model.safetensors.index.json) beside "
                      "config.json");
    }
    if (name.starts_with("rank-") && entry.path().extension() == ".safetensors") {
      throw UserError(dir.string() + ": holds " + name + ", a checkpoint's rank file, but not metadata.json and " +
                      "metadata.crc32c beside it, so it is not a complete checkpoint");
    }
    if (entry.path().extension() == ".safetensors") {
      throw UserError(dir.string() + ": holds " + entry.path().filename().string() +
                      " but neither model.safetensors nor model.safetensors.index.json, which name the "
                      "model's weights (a directory of config.json alone starts from random weights)");
    }
    if (name != "config.json" && !name.starts_with(".") && !entry.is_directory()) others.push_back(name);
  }
  if (others.empty()) return;
  std::sort(others.begin(), others.end());
  throw UserError(dir.string() + ": holds no weights (model.safetensors or model.safetensors.index.json), but " +
                  first_names(others, 3) + " beside config.json: were the weights left out of a download or a " +
                  "copy? A fresh model starts from a directory of config.json alone, or from " +
                  (dir / "config.json").string() + " named as [model] path");
}

// model.safetensors beside an index that places tensors in other files: transformers reads the
// single file, and a stale one beside a re-sharded save is the usual cause, so which set holds
// the model is the user's to say.
void require_one_weight_set(const fs::path& index, const std::set<std::string>& index_files) {
  if (index_files == std::set<std::string>{"model.safetensors"}) return;  // the index of the single file
  throw UserError(index.parent_path().string() + ": holds both model.safetensors and model.safetensors.index.json, "
                  "whose weight_map names " + std::to_string(index_files.size()) + " file(s) of its own; transformers "
                  "would read model.safetensors alone: remove whichever set is stale");
}

}  // namespace

HfWeights HfWeights::open(const fs::path& dir) {
  HfWeights weights;
  const fs::path index = dir / "model.safetensors.index.json";
  const fs::path single = dir / "model.safetensors";
  weights.dir_ = dir;
  if (present(index)) {
    const auto weight_map = parse_weight_map(read_text_file(index), index.string());
    if (present(single)) {
      std::set<std::string> files;
      for (const auto& [name, file] : weight_map) files.insert(file);
      require_one_weight_set(index, files);
    }
    std::map<std::string, std::shared_ptr<SafetensorsFile>> shards;
    for (const auto& [name, file] : weight_map) {
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
    require_config_alone(dir);
  }
  return weights;
}

HfWeights HfWeights::of_model_path(const fs::path& path) {
  if (fs::is_directory(path)) return open(path);
  const fs::path dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  for (const char* weights : {"model.safetensors", "model.safetensors.index.json"}) {
    if (fs::exists(dir / weights)) {
      throw UserError(path.string() + ": a config.json path starts the model afresh, but the weights " + weights +
                      " lie beside it; name the directory " + dir.string() + " to load them, or a copy of config.json "
                      "elsewhere to start afresh");
    }
  }
  return {};
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

std::string HfWeights::fingerprint() const {
  std::map<std::string, std::string> files;  // by name: its fingerprint
  for (const auto& [name, file] : where_) files.emplace(file->path().filename().string(), file->fingerprint());
  std::string text;
  for (const auto& [name, print] : files) text += (text.empty() ? "" : " ") + name + " " + print;
  return text;
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
  const HfWeights weights = HfWeights::of_model_path(base.path);
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
  std::vector<std::string> unused;
  for (const auto& name : weights.names()) {
    // RoPE tables are recomputed
    if (!used.count(name) && !name.ends_with("rotary_emb.inv_freq")) unused.push_back("'" + name + "'");
  }
  if (unused.empty()) return;
  log_warn(weights.dir().string(), ": ", unused.size(), " tensor(s) the model does not use: ", first_names(unused, 3));
}

void check_tied_copies_agree(CausalLM& model, const HfWeights& weights) {
  for (const auto& group : tied_parameter_groups(model)) {
    std::vector<std::string> held;
    for (const auto& name : group) {
      if (weights.contains(name)) held.push_back(name);
    }
    for (size_t i = 1; i < held.size(); ++i) {
      const at::Tensor first = weights.file_of(held[0]).tensor(held[0]);
      const at::Tensor other = weights.file_of(held[i]).tensor(held[i]);
      if (first.dtype() == other.dtype() && first.sizes() == other.sizes() && at::equal(first, other)) continue;
      throw UserError(weights.dir().string() + ": holds '" + held[0] + "' and '" + held[i] + "' of different values, " +
                      "but config.json ties them (tie_word_embeddings): transformers would untie them and train " +
                      "both; set tie_word_embeddings to false in config.json to do so, or drop '" + held[i] +
                      "' to tie them");
    }
  }
}

}  // namespace fsdpp
