// A training run's whole state as a sharded checkpoint (io/sharded_checkpoint.h), and its
// final HF export. Each rank saves its rows of every parameter and of AdamW's moments, plus
// its RNG state; rank 0 adds the metadata (step, meshes, config hash, schedule, data
// position, client state) and commits the directory. Restoring reads each rank's rows of the current sharding from
// whichever saved shards hold them, so a checkpoint loads at any world size or mesh.
#pragma once

#include "distributed/comm.h"
#include "fsdp/plan.h"
#include "fsdp/sharded_view.h"
#include "io/sharded_checkpoint.h"
#include "models/model_config.h"
#include "train/adamw.h"
#include "train/data.h"
#include "train/run_config.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>

namespace fsdpp {

// Where the loop stands after restoring: the last completed step and what it stored.
struct ResumePoint {
  int64_t step = 0;
  nlohmann::json client_state = nlohmann::json::object();
};

class RunCheckpointer {
 public:
  // `shards` are this rank's rows of every parameter (the optimizer's tensors); `data`
  // identifies the stream `order` indexes (file, range, seq_len, seed).
  // `lora`: the adapters the model carries, recorded so that an export can merge them. With
  // them, checkpoints hold only what trains (the adapters and trainable modules) and record
  // `base_identity` (model_source.h's, on rank 0) for the frozen rest.
  RunCheckpointer(const RunConfig& config, const ModelConfig& model, std::shared_ptr<Comm> world,
                  std::vector<ShardRows> shards, std::vector<std::string> meshes, AdamW& optimizer,
                  ShuffledOrder& order, nlohmann::json data, std::optional<LoraPlan> lora = std::nullopt,
                  std::string base_identity = {});

  // Saves step `step` under config.dir and rotates older checkpoints (collective; every
  // rank calls it). A step already saved is left as it is.
  void save(int64_t step, const nlohmann::json& client_state);

  // Restores the optimizer, data position and RNG state from `checkpoint`; the parameters
  // came in when the model was sharded (checkpoint_fill). A data stream the position cannot
  // carry over to is refused with the reason.
  ResumePoint restore(const ShardedCheckpoint& checkpoint);

 private:
  // Writes this rank's rows, moments and RNG state into `staging`; returns its file's
  // [bytes, checksum, microseconds from `start` to its commit] for the gather.
  at::Tensor write_rank_file(const std::filesystem::path& staging, std::chrono::steady_clock::time_point start) const;
  // Rank 0: writes config.json and the metadata with its checksum, renames `staging` to
  // `final_dir` and rotates; returns the checkpoints removed.
  std::vector<std::filesystem::path> commit(int64_t step, const nlohmann::json& client_state,
                                            const std::filesystem::path& staging,
                                            const std::filesystem::path& final_dir, const at::Tensor& files,
                                            const at::Tensor& rows) const;
  nlohmann::json metadata(int64_t step, const nlohmann::json& client_state, const at::Tensor& files,
                          const at::Tensor& rows) const;

  const RunConfig& config_;
  const ModelConfig& model_;
  std::shared_ptr<Comm> world_;
  std::vector<ShardRows> shards_;
  std::vector<std::string> meshes_;
  AdamW& optimizer_;
  ShuffledOrder& order_;
  nlohmann::json data_;
  std::optional<LoraPlan> lora_;
  std::string base_identity_;
  // Whether checkpoints hold these rows: all of them, except a LoRA run's frozen base.
  bool saves(const ShardRows& shard) const { return !lora_ || shard.rows.requires_grad(); }
};

// The checkpoint [checkpoint] resume names, or nullopt to start fresh ("" or "latest" with
// none saved yet). UserError when a named path is not a complete checkpoint.
std::optional<std::filesystem::path> resume_path(const CheckpointConfig& config);

// Writes the full model as an HF directory (config.export_dir, export_dtype, sharded above
// export_shard_mb), one unit gathered at a time: rank 0 streams each tensor to disk as it
// arrives, so no rank ever holds the whole model. Collective when `view` is sharded.
void export_model(const ModelConfig& model, ShardedView& view, int rank, const CheckpointConfig& config);
// Writes a LoRA run's adapters and trainable base modules as a PEFT adapter of `lora` into
// config.adapter_dir (a collective: each unit gathered in turn; rank 0 writes).
void export_adapter(const LoraPlan& lora, const std::string& base_model, ShardedView& view, int rank,
                    const CheckpointConfig& config);

// A hash of the settings that shape the run (every section but [checkpoint] and [train]).
std::string config_hash(const RunConfig& config);

}  // namespace fsdpp
