// Offline export of a sharded checkpoint to a Hugging Face directory: no process group, one
// machine, one full tensor in memory at a time.
#pragma once

#include <ATen/core/ScalarType.h>

#include <filesystem>
#include <optional>

namespace fsdpp {

struct ExportSummary {
  int64_t step = 0;
  int64_t tensors = 0;
  size_t bytes = 0;  // of tensor data written
};

// Reads every "model/" tensor of `checkpoint` (each file's checksum verified before use) and
// writes config.json plus safetensors to `out` in `dtype` (default: the dtype the run trained
// in), sharded with an index above `max_shard_bytes`. The checkpoint of a LoRA run exports
// only with `merge_lora`: each target's weight becomes W + (alpha / r) B A, the adapters go;
// an adapter-only one reads its frozen base from the base it records (its HF files, checked
// unchanged, or a fresh initialisation from the recorded seed).
ExportSummary export_checkpoint(const std::filesystem::path& checkpoint, const std::filesystem::path& out,
                                std::optional<at::ScalarType> dtype, size_t max_shard_bytes, bool merge_lora = false);
// The adapters of a LoRA run's `checkpoint` (and the base modules that train beside them),
// whole, written to `out` as the PEFT adapter the run writes at its end (in `dtype`, default
// the masters'): for serving a step other than the last.
ExportSummary export_adapter(const std::filesystem::path& checkpoint, const std::filesystem::path& out,
                             std::optional<at::ScalarType> dtype);

}  // namespace fsdpp
