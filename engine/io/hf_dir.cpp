// Loading and saving Hugging Face model directories.
#include "io/hf_dir.h"

#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
#include "core/module_tree.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>

namespace fsdpp {

namespace fs = std::filesystem;
using nlohmann::json;

HfWeights HfWeights::open(const fs::path& dir) {
  HfWeights weights;
  const fs::path index = dir / "model.safetensors.index.json";
  const fs::path single = dir / "model.safetensors";
  if (fs::exists(index)) {
    std::ifstream in(index);
    json j;
    try {
      j = json::parse(in);
    } catch (const json::parse_error& e) {
      throw UserError(index.string() + ": not valid JSON (" + e.what() + ")");
    }
    if (!j.contains("weight_map") || !j["weight_map"].is_object()) {
      throw UserError(index.string() + ": has no weight_map object");
    }
    std::map<std::string, std::shared_ptr<SafetensorsFile>> shards;
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string()) throw UserError(index.string() + ": weight_map['" + name + "'] is not a file name");
      auto& shard = shards[file.get<std::string>()];
      if (!shard) {
        const fs::path shard_path = dir / file.get<std::string>();
        if (!fs::exists(shard_path)) {
          throw UserError(index.string() + ": names shard " + shard_path.string() + ", which does not exist");
        }
        shard = SafetensorsFile::open(shard_path);
      }
      if (!shard->contains(name)) {
        throw UserError(shard->path().string() + ": missing tensor '" + name + "' that the index places there");
      }
      weights.where_[name] = shard;
    }
  } else if (fs::exists(single)) {
    auto file = SafetensorsFile::open(single);
    for (const auto& [name, entry] : file->entries()) weights.where_[name] = file;
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
  if (!fs::exists(path)) throw UserError(path.string() + ": no such model directory or config file");
  return fs::is_directory(path) ? path / "config.json" : path;
}

void load_hf_weights(CausalLM& model, const HfWeights& weights) {
  torch::NoGradGuard no_grad;
  std::map<std::string, bool> used;
  for (auto& [name, param] : unique_named_parameters(model)) {
    if (!weights.contains(name)) {
      throw UserError("model weights: missing tensor '" + name + "'");
    }
    const SafetensorsFile& file = weights.file_of(name);
    at::Tensor source = file.tensor(name);
    const std::string where = file.path().string() + ": tensor '" + name + "'";
    if (source.sizes() != param.sizes()) {
      throw UserError(where + " has shape " + c10::str(source.sizes()) + " but the model expects " +
                      c10::str(param.sizes()));
    }
    if (!at::isFloatingType(source.scalar_type())) {
      throw UserError(where + " has dtype " + c10::toString(source.scalar_type()) +
                      " but the model expects a floating type");
    }
    param.copy_(source);
    used[name] = true;
  }
  std::vector<std::string> tied;
  for (const auto& group : tied_parameter_groups(model)) tied.insert(tied.end(), group.begin(), group.end());
  for (const auto& name : weights.names()) {
    const bool recomputed = name.ends_with("rotary_emb.inv_freq");
    const bool is_tied = std::find(tied.begin(), tied.end(), name) != tied.end();
    if (!used.count(name) && !recomputed && !is_tied) {
      log_warn(weights.file_of(name).path().string(), ": tensor '", name, "' is not used by the model");
    }
  }
}

void save_hf_dir(CausalLM& model, const fs::path& dir, at::ScalarType dtype) {
  NamedTensors tensors;
  for (const auto& p : unique_named_parameters(model)) tensors.emplace_back(p.name, p.tensor);
  save_hf_dir(model.config(), tensors, dir, dtype);
}

void save_hf_dir(const ModelConfig& model_config, const NamedTensors& tensors, const fs::path& dir,
                 at::ScalarType dtype, size_t max_shard_bytes) {
  fs::create_directories(dir);
  json config = model_config.raw ? *model_config.raw : json::object();
  // Older readers know only torch_dtype; newer ones still accept it.
  config.erase("dtype");
  config["torch_dtype"] = dtype_name(dtype);
  const std::string config_text = config.dump(2) + "\n";
  write_file_atomically(dir / "config.json", config_text.data(), config_text.size());

  std::vector<NamedTensors> shards(1);
  size_t shard_bytes = 0, total_bytes = 0;
  for (const auto& [name, param] : tensors) {
    at::Tensor t = param.detach().to(at::kCPU, dtype);
    const size_t bytes = t.numel() * t.element_size();
    if (shard_bytes > 0 && shard_bytes + bytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().emplace_back(name, t);
    shard_bytes += bytes;
    total_bytes += bytes;
  }
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  if (shards.size() == 1) {
    write_safetensors(dir / "model.safetensors", shards[0], meta);
    fs::remove(dir / "model.safetensors.index.json");
    return;
  }
  json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", json::object()}};
  for (size_t i = 0; i < shards.size(); ++i) {
    char file[64];
    std::snprintf(file, sizeof file, "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    write_safetensors(dir / file, shards[i], meta);
    for (const auto& [name, t] : shards[i]) index["weight_map"][name] = file;
  }
  const std::string index_text = index.dump(2) + "\n";
  write_file_atomically(dir / "model.safetensors.index.json", index_text.data(), index_text.size());
  fs::remove(dir / "model.safetensors");
}

}  // namespace fsdpp
