// Hugging Face model directories: config.json plus weights in model.safetensors or in
// shards listed by model.safetensors.index.json.
#pragma once

#include "io/safetensors.h"
#include "models/causal_lm.h"

#include <nlohmann/json_fwd.hpp>

#include <filesystem>
#include <map>
#include <optional>

namespace fsdpp {

// The weights of an HF directory, by tensor name, each in the file that holds it.
class HfWeights {
 public:
  // Opens the single file or every shard the index names; a directory with no weight files
  // at all yields an empty set (a model to initialise). UserError for weights that are there
  // but unusable: a link to nothing, a file or index of no tensors, or shards without their
  // index, any of which would otherwise start the run from random weights.
  static HfWeights open(const std::filesystem::path& dir);
  // The weights a model path names: a directory's (open), none for a config.json file, which
  // starts a model afresh. A UserError for a config.json beside weights, which would start
  // afresh where the weights were surely meant.
  static HfWeights of_model_path(const std::filesystem::path& path);

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
  // Each file's name and sampled fingerprint (file_fingerprint), in name order: what tells
  // copies of the same weights from other weights, without reading them whole.
  std::string fingerprint() const;

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

// What identifies the base model a LoRA run's adapter-only checkpoints stand on: where it lay,
// and the CRC-32C of each weight file, or for a fresh base (no weights) that of its
// config.json and the seed it was drawn from. Checkpoint metadata records it as JSON, through
// its one writer and reader below.
struct BaseIdentity {
  std::filesystem::path path;                  // absolute
  std::map<std::string, std::string> files;    // weight file name -> CRC-32C; none for a fresh base
  std::string config_checksum;                 // a fresh base's config.json
  std::optional<uint64_t> init_seed;           // a fresh base's seed

  // The identity of the base at `path` as it is now.
  static BaseIdentity of(const std::filesystem::path& path, uint64_t init_seed);
  // A UserError naming `where` unless `now` is this base, wherever it lies: another model, or
  // the same files changed, is refused.
  void check_same(const BaseIdentity& now, const std::string& where) const;
};
void to_json(nlohmann::json& j, const BaseIdentity& base);
void from_json(const nlohmann::json& j, BaseIdentity& base);
// Warns, on one line, of the tensors in `weights` that no parameter of `model` (nor a tied
// alias) uses.
void warn_unused_hf_tensors(CausalLM& model, const HfWeights& weights);
// A UserError where `weights` holds two names of one of `model`'s tied parameters (an output
// head tied to the embedding) with different values: transformers unties such a pair and
// trains both, where `model` would hold one.
void check_tied_copies_agree(CausalLM& model, const HfWeights& weights);

}  // namespace fsdpp
