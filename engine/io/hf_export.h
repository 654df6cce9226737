// Writing Hugging Face model directories: an export that transformers loads, written aside
// and swapped in whole, which replaces nothing but an earlier export.
#pragma once

#include "io/safetensors.h"
#include "models/model_config.h"

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace fsdpp {

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
