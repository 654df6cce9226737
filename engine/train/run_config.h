// One run's whole configuration: each TOML section parsed by the component that owns it,
// plus the [train] and [checkpoint] sections the training loop owns.
#pragma once

#include "core/config_file.h"
#include "dist/dist_env.h"
#include "train/adamw.h"
#include "train/data.h"
#include "train/lr_schedule.h"
#include "train/metrics.h"
#include "train/model_source.h"

#include <filesystem>
#include <vector>

namespace fsdpp {

struct TrainConfig {
  int64_t steps = 1000;          // optimizer steps
  int64_t grad_accum = 1;        // micro-batches per step
  bool sync_each_micro_batch = true;  // sharded runs: reduce gradients after every micro-batch;
                                      // false keeps full gradients until the last one
  double clip_grad_norm = 1.0;   // global-norm clipping threshold; 0 disables
  int64_t log_every = 10;        // steps between log lines
  int64_t eval_every = 0;        // steps between held-out evaluations; 0 disables
  int64_t eval_batches = 8;      // micro-batches per evaluation
  int64_t threads = 0;           // intra-op threads; 0 keeps LibTorch's default
  std::string out_dir = "runs/default";  // metrics and saved models go here

  static TrainConfig from_section(ConfigSection& section);
};

struct CheckpointConfig {
  int64_t save_every = 0;   // steps between saves of the model as an HF directory; 0: never
  bool save_final = true;   // save once more after the last step
  std::string dir;          // "" means <train.out_dir>/model

  static CheckpointConfig from_section(ConfigSection& section);
};

struct RunConfig {
  std::filesystem::path file;
  ConfigFile source;  // for sections owned above this layer ([policy])
  ModelSourceConfig model;
  DataConfig data;
  OptimizerConfig optimizer;
  ScheduleConfig scheduler;
  TrainConfig train;
  CheckpointConfig checkpoint;
  MetricsConfig metrics;
  ParallelConfig parallel;

  // Parses and validates every section of `path` after applying `overrides`.
  static RunConfig load(const std::filesystem::path& path, const std::vector<std::string>& overrides);
};

}  // namespace fsdpp
