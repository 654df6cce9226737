// Setting up a run (rendezvous, data, plan, weights, shards, optimizer, checkpointer) and
// resuming it from a checkpoint.
#include "train/session.h"

#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
#include "distributed/dist_env.h"
#include "fsdp/fsdp_state.h"
#include "io/hf_dir.h"
#include "models/registry.h"

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <utility>
#include <vector>

namespace fsdpp {

namespace {

using nlohmann::json;

// Rank r trains rows [r * rows, (r + 1) * rows) of every global micro-batch.
int64_t rows_per_rank(const RunConfig& config, int world) {
  if (config.data.batch_size % world != 0) {
    throw UserError(config.file.string() + ": [data] batch_size " + std::to_string(config.data.batch_size) +
                    " is not a multiple of the world size " + std::to_string(world) +
                    " (each rank takes batch_size / world sequences)");
  }
  return config.data.batch_size / world;
}

std::shared_ptr<const ShardedCheckpoint> open_resume_checkpoint(const CheckpointConfig& config, int rank) {
  if (auto path = resume_path(config)) return std::make_shared<const ShardedCheckpoint>(ShardedCheckpoint::open(*path));
  if (config.resume == "latest" && rank == 0) log_info("resume: no checkpoint in ", config.dir, " yet; starting fresh");
  return nullptr;
}

// The dtypes the run computes and reduces in, per kind of unit, and its masters':
// "compute bfloat16, reduce float32 (12 units); compute float32, reduce float32 (1 unit); masters float32".
std::string precision_line(const ResolvedPlan& resolved, at::ScalarType masters) {
  std::vector<std::pair<std::string, int>> kinds;  // in the order units first show them
  for (const auto& unit : resolved.units) {
    const std::string kind = "compute " + dtype_name(unit.compute_dtype) + ", reduce " + dtype_name(unit.reduce_dtype);
    auto it = std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == kind; });
    if (it == kinds.end()) it = kinds.insert(kinds.end(), {kind, 0});
    ++it->second;
  }
  std::string line;
  for (const auto& [kind, units] : kinds) {
    line += kind + " (" + std::to_string(units) + (units == 1 ? " unit); " : " units); ");
  }
  return line + "masters " + dtype_name(masters);
}

// Shards the model by the policy's plan, each rank filling its rows from the checkpoint or
// the loaded weights, which are then unmapped.
std::unique_ptr<FsdpState> shard_model(const RunConfig& config, const Plan& plan, Session& s) {
  CausalLM& model = *s.loaded.model;
  const int rank = s.comm->rank(), world = s.comm->size();
  const at::ScalarType model_dtype = parse_dtype(config.model.dtype);
  const ResolvedPlan resolved = resolve_plan(plan, model, world, model_dtype);
  if (rank == 0) {
    const std::string constants = resolved.constant_param_bytes == 0 ? "" : " (" +
        std::to_string(resolved.constant_param_bytes) + " B of them frozen, held in their compute dtype)";
    log_info("plan: ", resolved.units.size(), " units; per rank: parameters ", resolved.param_bytes, " B", constants,
             ", gradients ", resolved.grad_bytes, " B, optimizer state ", resolved.optimizer_bytes, " B");
    log_info("precision: ", precision_line(resolved, master_dtype(model_dtype)));
  }
  auto fsdp = std::make_unique<FsdpState>(model, s.comm, resolved,
                                          s.checkpoint ? checkpoint_fill(s.checkpoint, s.loaded.fill) : s.loaded.fill,
                                          s.device);
  if (s.loaded.weights && !s.checkpoint) {
    if (rank == 0) warn_unused_hf_tensors(model, *s.loaded.weights);
    // Touched pages of the mapped files, read from the kernel: what this rank really read.
    const size_t touched = s.loaded.weights->resident_bytes(), total = s.loaded.weights->file_bytes();
    log_info("weights: rank ", rank, " read ", touched, " of ", total, " bytes of the HF files (",
             100.0 * static_cast<double>(touched) / static_cast<double>(std::max<size_t>(total, 1)), "%)");
  }
  s.loaded.fill = {};
  s.loaded.weights.reset();  // unmaps the files
  s.units = fsdp->units().size();
  // Read from the shard tensors themselves, for comparison with what `fsdpp plan` predicts.
  int64_t shard_bytes = 0;
  std::string names;
  for (const auto& unit : fsdp->units()) {
    names += (names.empty() ? "" : ",") + unit->name();
    for (const auto& p : unit->params()) shard_bytes += p.local.numel() * p.local.element_size();
  }
  log_info("sharded: ", fsdp->units().size(), " units [", names, "], parameter shards ", shard_bytes, " bytes");
  return fsdp;
}

}  // namespace

Session set_up(const RunConfig& config, const PlanBuilder& build_plan) {
  Session s;
  const DistEnv env = DistEnv::from_environment();
  // Before the rendezvous: every rank refuses a batch it cannot split alike, where a rank
  // leaving mid-rendezvous would make the others report a lost connection instead.
  s.rows = rows_per_rank(config, env.world_size);
  s.comm = init_distributed(env, config.parallel);
  const int rank = s.comm->rank();
  s.device = s.comm->device();
  // Seeded per rank, so anything random and the RNG states checkpoints save are reproducible.
  at::manual_seed(config.model.init_seed + static_cast<uint64_t>(rank));
  s.checkpoint = open_resume_checkpoint(config.checkpoint, rank);
  if (s.checkpoint) {  // adapters resume only onto the base they were trained on
    const auto saved = s.checkpoint->metadata().value("model", json::object());
    // One rank per node reads the base's files through (each node may hold a copy of its
    // own); where it refuses, its exit ends the run for every rank.
    if (saved.contains("base") && env.local_rank == 0) {
      check_base_identity(saved["base"].dump(), config.model.path, config.model.init_seed, s.checkpoint->dir().string());
    }
  }
  // The data first: a bad token file is reported before the model takes its time to load.
  const ModelConfig model_config = model_config_of(config.model);
  s.batches = open_batches(config.data, model_config);
  config.experts.check_model(model_config, config.file.string());
  // The policy reads a skeleton of the model (no memory): its units shard the run, one rank
  // or many, and its LoRA declaration puts adapters on the model before its values load.
  const Plan plan = build_plan(*build_model(model_config, torch::TensorOptions().dtype(parse_dtype(config.model.dtype))
                                                              .device(torch::kMeta)),
                               s.comm->size(), rank);
  s.loaded = load_model(config.model, /*unallocated=*/true, plan.lora ? &*plan.lora : nullptr);
  CausalLM& model = *s.loaded.model;
  s.parameters = model.recursive_param_count();  // numel holds for unallocated parameters too
  model.train();
  s.view = shard_model(config, plan, s);  // places the model unit by unit
  s.optimizer = std::make_unique<AdamW>(decay_groups(s.view->sharded_parameters(), config.optimizer.weight_decay),
                                        config.optimizer);
  s.checkpointer = std::make_unique<RunCheckpointer>(config, model.config(), s.comm, s.view->shard_rows(),
                                                     s.view->mesh_shapes(), *s.optimizer, s.batches->order(),
                                                     s.batches->identity(), s.loaded.lora,
                                                     rank == 0 && s.loaded.lora
                                                         ? base_identity(config.model.path, config.model.init_seed)
                                                         : "");
  if (const auto& moe = model.config().moe) {
    s.experts.emplace(*moe, config.experts, routing_bias_names(model), config.train.grad_accum);
  }
  return s;
}

int64_t resume(Session& s, TrainSummary& summary, std::chrono::steady_clock::time_point load_start) {
  const ResumePoint point = s.checkpointer->restore(*s.checkpoint);
  summary.steps = point.step;
  summary.skipped_steps = point.client_state.value("skipped_steps", int64_t{0});
  const ReadStats read = s.checkpoint->read_stats();
  const double rebuild_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
  log_info("resume: rank ", s.comm->rank(), " read ", read.bytes, " bytes of ", s.checkpoint->dir().string(),
           " (saved at world ", s.checkpoint->world_size(), ") in ", read.seconds, " s (",
           static_cast<double>(read.bytes) / std::max(read.seconds, 1e-9) / 1e9, " GB/s; ", rebuild_s,
           " s to rebuild the run); continuing after step ", point.step);
  return point.step + 1;
}

}  // namespace fsdpp
