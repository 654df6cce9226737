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
// Warns of each tensor in `weights` that no parameter of `model` (nor a tied alias) uses.
void warn_unused_hf_tensors(CausalLM& model, const HfWeights& weights);

// Refuses, in one line, an export into `dir` that would delete anything but an earlier
// export: `dir` may be missing, an empty directory, or a directory of files an export writes
// whose weights bear an export's mark (or a link to one of these directories). In the out_dir
// of a run that recorded itself there (`in_own_run_dir`) no mark is needed: exports from
// before the mark are there.
void check_export_target(const std::filesystem::path& dir, bool in_own_run_dir = false);

// Writes an HF directory tensor by tensor: config.json, the tokenizer, chat template and
// generation config of `source` (the model directory the weights came from, when there is
// one), then the tensors of `specs` (HF names, full shapes, each in its dtype; `dtype` is
// the one config.json names) in order, into
// model.safetensors, or into shards of at most `max_shard_bytes` listed by an index when they
// are larger. Holds one tensor at a time. Where `dir` is a link, the directory it names is
// replaced and the link kept. All of it goes into a fresh directory beside `dir`,
// which finish() swaps in for `dir` at once: no file of an earlier export survives, and a
// reader never sees half of either. A `dir` holding anything else, or `source` itself, is
// refused at once (check_export_target, to which `in_own_run_dir` passes).
class HfDirWriter {
 public:
  HfDirWriter(const ModelConfig& config, const std::vector<TensorSpec>& specs, const std::filesystem::path& dir,
              at::ScalarType dtype, size_t max_shard_bytes = size_t{2} << 30,
              const std::filesystem::path& source = {}, bool in_own_run_dir = false);
  ~HfDirWriter();

  void write(const std::string& name, const at::Tensor& full);
  void finish();

 private:
  std::filesystem::path dir_;      // where the export ends up
  std::filesystem::path staging_;  // where it is written
  void write_index() const;        // model.safetensors.index.json of a sharded export
  std::vector<std::vector<TensorSpec>> shards_;
  std::vector<std::string> files_;
  size_t shard_ = 0, in_shard_ = 0;
  std::unique_ptr<SafetensorsWriter> writer_;
};

}  // namespace fsdpp
