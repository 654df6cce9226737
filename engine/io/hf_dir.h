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
  const std::filesystem::path& dir() const { return dir_; }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  const SafetensorsFile& file_of(const std::string& name) const;
  std::vector<std::string> names() const;
  // Sizes of the mapped files, and how much of them this process has touched.
  size_t file_bytes() const;
  size_t resident_bytes() const;
  // For reading slices (each rank its own rows): no read-ahead around each page fault.
  void advise_random() const;

 private:
  std::map<std::string, std::shared_ptr<SafetensorsFile>> where_;
  std::filesystem::path dir_;
};

// config.json of a directory, or the file itself when `path` names one.
std::filesystem::path hf_config_path(const std::filesystem::path& path);

// Copies rows [first_row, first_row + out.size(0)) of the tensor stored under the first of
// `names` the files hold (a parameter's name, then its tied aliases) into `out`, converting
// between floating dtypes. Only those rows' pages of the mapping are touched. A missing
// tensor, a shape other than `full_shape` or a non-floating dtype is a UserError naming the
// file and tensor.
void read_hf_rows(const HfWeights& weights, const std::vector<std::string>& names,
                  c10::IntArrayRef full_shape, at::Tensor& out, int64_t first_row);

// What identifies the base model at `path` as JSON text: its absolute path and the CRC-32C of
// each weight file, or of its config.json and `init_seed` for a fresh one (no weights). A
// LoRA run's adapter-only checkpoints record it.
std::string base_identity(const std::filesystem::path& path, uint64_t init_seed);
// A UserError naming `where` unless `recorded` (base_identity's text) is the identity of the
// base at `path` now, wherever it lies: another model, or the same files changed, is refused.
void check_base_identity(const std::string& recorded, const std::filesystem::path& path, uint64_t init_seed,
                         const std::string& where);
// Warns of each tensor in `weights` that no parameter of `model` (nor a tied alias) uses.
void warn_unused_hf_tensors(CausalLM& model, const HfWeights& weights);

// Writes an HF directory tensor by tensor: config.json, then the tensors of `specs` (HF
// names, full shapes) in order, into model.safetensors, or into shards of at most
// `max_shard_bytes` listed by an index when they are larger. Holds one tensor at a time.
class HfDirWriter {
 public:
  HfDirWriter(const ModelConfig& config, const std::vector<TensorSpec>& specs, const std::filesystem::path& dir,
              at::ScalarType dtype, size_t max_shard_bytes = size_t{2} << 30);
  ~HfDirWriter();

  void write(const std::string& name, const at::Tensor& full);
  void finish();

 private:
  std::filesystem::path dir_;
  std::vector<std::vector<TensorSpec>> shards_;
  std::vector<std::string> files_;
  size_t shard_ = 0, in_shard_ = 0;
  std::unique_ptr<SafetensorsWriter> writer_;
};

}  // namespace fsdpp
