// What a training run builds before its first step: the process group, the model sharded by
// the policy's plan (over one rank as over many), its batches, the optimizer over its
// shards, the checkpointer, and the checkpoint it resumes from.
#pragma once

#include "distributed/comm.h"
#include "fsdp/sharded_view.h"
#include "io/sharded_checkpoint.h"
#include "train/adamw.h"
#include "train/batches.h"
#include "train/expert_balance.h"
#include "train/model_source.h"
#include "train/run_checkpoint.h"
#include "train/run_config.h"
#include "train/trainer.h"

#include <chrono>
#include <memory>
#include <optional>

namespace fsdpp {

// Everything a run builds before its first step, in the order it is built.
struct Session {
  std::shared_ptr<Comm> comm;
  c10::Device device = at::kCPU;
  int64_t rows = 0;  // this rank's rows of every global micro-batch
  size_t units = 0;  // the plan's FSDP units
  int64_t parameters = 0;  // the whole model's, counted before sharding
  std::shared_ptr<const ShardedCheckpoint> checkpoint;  // the one to resume from, if any
  LoadedModel loaded;
  std::unique_ptr<ShardedView> view;  // the FsdpState of the policy's plan
  std::unique_ptr<Batches> batches;
  std::unique_ptr<AdamW> optimizer;
  std::unique_ptr<RunCheckpointer> checkpointer;
  std::optional<ExpertBalance> experts;  // mixture-of-experts models
};

// Builds the run's session for this rank (a collective): the rendezvous, the data, the
// policy's plan over a skeleton of the model, the weights, the shards.
Session set_up(const RunConfig& config, const PlanBuilder& build_plan);

// Restores the run from s.checkpoint into the session and `summary`, logging the read rate
// and the time since `load_start` (the whole rebuild); returns the first step still to train.
int64_t resume(Session& s, TrainSummary& summary, std::chrono::steady_clock::time_point load_start);

}  // namespace fsdpp
