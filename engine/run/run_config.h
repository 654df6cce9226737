// One run's whole configuration: each TOML section parsed by the component that owns it,
// plus the [train] and [checkpoint] sections the training loop owns.
#pragma once

#include "bindings/lua/policy_config.h"
#include "core/config_file.h"
#include "data/data_config.h"
#include "distributed/parallel_config.h"
#include "io/model_source_config.h"
#include "loss/experts_config.h"
#include "metrics/metrics_config.h"
#include "optim/loss_scale.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer_config.h"

#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace fsdpp {

struct TrainConfig {
  int64_t steps = 1000;          // optimizer steps
  int64_t grad_accum = 1;        // micro-batches per step
  bool sync_each_micro_batch = true;  // sharded runs: reduce gradients after every micro-batch;
                                      // false keeps full gradients until the last one
  double clip_grad_norm = 1.0;   // global-norm clipping threshold; 0 disables
  int64_t log_every = 10;        // steps between log lines
  int64_t eval_every = 0;        // steps between held-out evaluations, and one after the last; 0 disables
  int64_t eval_batches = 8;      // micro-batches per evaluation
  int64_t threads = 0;           // intra-op threads; 0 keeps LibTorch's default
  std::string out_dir = "runs/default";  // metrics and saved models go here; one run's alone
  bool reuse_out_dir = false;    // true: train into an out_dir that holds another run's files

  static TrainConfig from_section(ConfigSection& section);
};

// Where a run starts: afresh, from the newest complete checkpoint in [checkpoint] dir (afresh
// when there is none), or from a named checkpoint directory.
struct ResumeFrom {
  enum class Kind { fresh, latest, path };
  Kind kind = Kind::fresh;
  std::filesystem::path path;  // Kind::path's checkpoint

  bool operator==(const ResumeFrom&) const = default;
};

struct CheckpointConfig {
  std::string dir;              // sharded checkpoints go to <dir>/step-00000100; "" means <train.out_dir>/checkpoints
                                // (checkpoints-<settings hash> under [train] reuse_out_dir)
  int64_t save_every = 0;       // steps between sharded checkpoints; 0: none
  bool save_final = true;       // after the last step: a sharded checkpoint and the HF export
  int64_t keep = 3;             // complete checkpoints kept, newest first; 0 keeps all
  double max_gb = 0.0;          // also delete the oldest while all together exceed this (never the newest); 0: no cap
  ResumeFrom resume;            // "latest", a checkpoint directory, or "" to start fresh
  bool save_on_signal = true;   // on SIGTERM or SIGINT: finish the step, save, exit with 128 + the signal
  std::string export_dir;       // the HF export of the final model; "" means <train.out_dir>/model (model-<settings
                                // hash> under [train] reuse_out_dir)
  std::string adapter_dir;      // a LoRA run's final adapter, in PEFT's layout; "" means <train.out_dir>/adapter
                                // (adapter-<settings hash> under [train] reuse_out_dir)
  at::ScalarType export_dtype = at::kFloat;  // its dtype; absent or "": [model] dtype
  double export_shard_mb = 2048;  // largest safetensors file of the export in MiB; above it the export is sharded

  // The export's dtype defaults to `model_dtype`, the [model] section's.
  static CheckpointConfig from_section(ConfigSection& section, at::ScalarType model_dtype);
};

struct RunConfig {
  std::filesystem::path file;
  ConfigFile source;  // the file as read, --set applied: checkpoints record a hash of its settings
  ModelSourceConfig model;
  DataConfig data;
  OptimizerConfig optimizer;
  LossScaleConfig loss_scale;
  ScheduleConfig scheduler;
  TrainConfig train;
  CheckpointConfig checkpoint;
  MetricsConfig metrics;
  ExpertsConfig experts;
  ParallelConfig parallel;
  PolicyConfig policy;

  // Parses and validates every section of `path` after applying `overrides` (named in
  // messages as ConfigFile::load names them).
  static RunConfig load(const std::filesystem::path& path, const std::vector<std::string>& overrides,
                        const std::string& override_label = "--set");
  // Parses and validates every section of a file already read.
  static RunConfig parse(const ConfigFile& file);
  // Every path the run file names must exist; one line naming the key, where it was given
  // and, for a relative path, the directory it resolves against. Apart from parse, which
  // reads text alone.
  void check_paths() const;
  // A run that draws its own batches (fsdpp train, fsdpp eval) needs [data] train.
  void require_data() const;
  // fsdpp train's own loop: [train] eval_every evaluates a held-out part, which [data]
  // eval_fraction must hold out (fsdpp eval and a caller-driven run follow no schedule), in
  // windows an evaluation can score (check_eval_seq_len).
  void check_eval_schedule() const;
  // An evaluation's windows of [data] seq_len tokens predict from 2 or more.
  void check_eval_seq_len() const;
  // [experts] asks nothing of `model` that it lacks (routing biases to move), blamed on where
  // the key was given.
  void check_experts(const ModelConfig& model) const;
};

// The settings that shape the run, by dotted key (every section but [checkpoint] and
// [metrics], and of [train] only what changes the updates), and a hash of them.
std::map<std::string, std::string> run_settings(const RunConfig& config);
std::string config_hash(const RunConfig& config);
// "-" and the hash's hex digits: what names a run's own outputs beside other runs' ([train]
// reuse_out_dir): checkpoints-<hash>, model-<hash>, ...
std::string settings_suffix(const RunConfig& config);

}  // namespace fsdpp
