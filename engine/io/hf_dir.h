// Hugging Face model directories: config.json plus weights in model.safetensors or in
// shards listed by model.safetensors.index.json.
#pragma once

#include "io/safetensors.h"
#include "models/causal_lm.h"

#include <filesystem>
#include <map>

namespace fsdpp {

// The weights of an HF directory, by tensor name, each in the file that holds it.
class HfWeights {
 public:
  // Opens the single file or every shard the index names; a directory without weights
  // yields an empty set.
  static HfWeights open(const std::filesystem::path& dir);

  bool empty() const { return where_.empty(); }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  const SafetensorsFile& file_of(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  std::map<std::string, std::shared_ptr<SafetensorsFile>> where_;
};

// config.json of a directory, or the file itself when `path` names one.
std::filesystem::path hf_config_path(const std::filesystem::path& path);

// Copies every parameter of `model` from `weights`, converting between floating dtypes.
// A missing tensor, a shape mismatch or a non-floating dtype is a UserError naming the
// file and tensor. Tensors the model lacks are reported as a warning.
void load_hf_weights(CausalLM& model, const HfWeights& weights);

// Writes `tensors` (full parameters, HF names) of a model of `config` as an HF directory
// in `dtype`: config.json and model.safetensors, or shards of at most `max_shard_bytes`
// with an index when larger.
void save_hf_dir(const ModelConfig& config, const NamedTensors& tensors, const std::filesystem::path& dir,
                 at::ScalarType dtype, size_t max_shard_bytes = size_t{2} << 30);
void save_hf_dir(CausalLM& model, const std::filesystem::path& dir, at::ScalarType dtype);

}  // namespace fsdpp
