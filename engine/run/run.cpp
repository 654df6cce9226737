// Building a run in order, and training one step of it.
#include "run/run.h"

#include "bindings/lua/policy.h"
#include "core/checksum.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/failpoint.h"
#include "core/log.h"
#include "distributed/dist_env.h"
#include "fsdp/fsdp_state.h"
#include "fsdp/plan_agreement.h"
#include "io/sharded_checkpoint.h"
#include "loss/next_token_loss.h"
#include "models/registry.h"
#include "run/out_dir.h"
#include "run/rank_agreement.h"
#include "run/run_checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace fsdpp {

namespace {

using nlohmann::json;

// Rank r trains rows [r * rows, (r + 1) * rows) of every global micro-batch.
int64_t rows_per_rank(const RunConfig& config, int world) {
  if (config.data.batch_size % world != 0) {
    throw UserError(config.source.where("data", "batch_size") + ": [data] batch_size " + std::to_string(config.data.batch_size) +
                    " is not a multiple of the world size " + std::to_string(world) +
                    " (each rank takes batch_size / world sequences)");
  }
  return config.data.batch_size / world;
}

// The dtypes the run computes and reduces in, per kind of unit, and its masters':
// "compute bfloat16, reduce float32 (12 units); compute float32, reduce float32 (1 unit); masters float32".
std::string precision_line(const ResolvedPlan& resolved, at::ScalarType masters) {
  std::vector<std::pair<std::string, int>> kinds;  // in the order units first show them
  for (const auto& unit : resolved.units) {
    const std::string kind = "compute " + dtype_name(unit.compute_dtype) +
                             (unit.declared.compute == ProductPrecision::fp8 ? " with float8 products" : "") +
                             ", reduce " + dtype_name(unit.reduce_dtype);
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

// What this rank holds once sharded, read from the shard tensors themselves for comparison
// with what `fsdpp plan` predicts.
void log_shards(const FsdpState& fsdp) {
  int64_t shard_bytes = 0;
  std::string names;
  for (const auto& unit : fsdp.units()) {
    names += (names.empty() ? "" : ",") + unit->name();
    for (const auto& p : unit->params()) shard_bytes += p.local.numel() * p.local.element_size();
  }
  log_info("sharded: ", fsdp.units().size(), " units [", names, "], parameter shards ", shard_bytes, " bytes");
}

// The checkpoint [checkpoint] resume names, refused where a later one of this run lies in
// [checkpoint] dir, or where its adapters were trained on another base; none to start fresh.
std::shared_ptr<const ShardedCheckpoint> open_resume_checkpoint(const RunConfig& config, const DistEnv& env) {
  const auto path = resume_path(config);
  if (!path) {
    if (config.checkpoint.resume.kind == ResumeFrom::Kind::latest && env.rank == 0) {
      // Checkpoints there of other settings are most often this run's under a changed setting
      // (a data file moved to another path): starting afresh beside them deserves a warning.
      const size_t beside = list_checkpoints(config.checkpoint.dir).size();
      if (beside == 0) {
        log_info("resume: no checkpoint of this run in ", config.checkpoint.dir, " yet; starting fresh");
      } else {
        log_warn("resume: none of the ", beside, " checkpoints in ", config.checkpoint.dir, " is of these settings ",
                 "(they are other settings' runs), so this run starts fresh at step 0: was a setting changed by "
                 "mistake (a data file given by another path)?");
      }
    }
    return nullptr;
  }
  auto checkpoint = std::make_shared<const ShardedCheckpoint>(ShardedCheckpoint::open(*path));
  if (const auto later = later_of_this_run(config, config.checkpoint.dir, checkpoint->step())) {
    throw UserError(config.source.where("checkpoint", "resume") + ": [checkpoint] resume: " + path->string() +
                    " is step " + std::to_string(checkpoint->step()) + ", but " + later->string() +
                    " is a later checkpoint of this run in [checkpoint] dir: a restart's resume = \"latest\" would "
                    "take it, and rotation would delete the new saves as the oldest; move the later ones away, or "
                    "set [checkpoint] dir elsewhere");
  }
  const auto saved = checkpoint->metadata().value("model", json::object());
  // Adapters resume only onto the base they were trained on. One rank per node reads the
  // base's files through (each node may hold a copy of its own); where it refuses, its exit
  // ends the run for every rank.
  if (saved.contains("base") && env.local_rank == 0) {
    saved["base"].get<BaseIdentity>().check_same(base_identity_of(config.model), checkpoint->dir().string());
  }
  return checkpoint;
}

// Whether host-resident units update on a host thread beside the next forward (said once).
bool overlap_host_updates(const OptimizerConfig& optimizer, c10::Device device, const FsdpState& fsdp, int rank) {
  using HostUpdate = OptimizerConfig::HostUpdate;
  const bool overlaps = optimizer.host_update == HostUpdate::overlapped ||
                        (optimizer.host_update == HostUpdate::automatic && !device.is_cpu());
  const size_t host_units = fsdp.host_update_batches().size();
  if (overlaps && host_units > 0 && rank == 0) {
    log_info("optimizer: ", host_units, " of ", fsdp.units().size(),
             " units update on a host thread while the next forward begins ([optimizer] host_update)");
    if (device.is_cpu() && at::get_num_threads() > 1) {
      log_warn("optimizer: on a CPU run the overlapped update and the forward each run ", at::get_num_threads(),
               " threads on the same cores; host_update = \"in_step\" is faster unless cores are left over");
    }
  }
  return overlaps;
}

// The loss scaler [loss_scale] asks for, where a backward runs: by default, for units computing
// in float16 alone.
std::optional<LossScaler> loss_scaler(const LossScaleConfig& config, bool computes_float16, bool frozen, int rank) {
  using LossScaleMode = LossScaleConfig::Mode;
  if (frozen) return std::nullopt;  // no backward: nothing to scale
  if (config.mode == LossScaleMode::dynamic || (config.mode == LossScaleMode::automatic && computes_float16)) {
    LossScaler scaler(config);
    if (rank == 0) log_info("loss scale: dynamic, from ", scaler.scale(), " ([loss_scale])");
    return scaler;
  }
  if (computes_float16 && rank == 0) {
    log_warn("loss scale: off with units computing in float16 ([loss_scale] mode = \"off\"): small gradients "
             "flush to zero");
  }
  return std::nullopt;
}

// A model whose every layer is dense (Qwen3-MoE's mlp_only_layers naming them all) routes
// nothing, and transformers adds no load-balancing loss for it.
bool routes_tokens(const ModelConfig& shape) {
  if (!shape.moe) return false;
  for (int64_t layer = 0; layer < shape.num_hidden_layers; ++layer) {
    if (shape.moe->is_moe_layer(layer)) return true;
  }
  return false;
}

}  // namespace

Run::Run(const RunConfig& config, const PlanBuilder& build_plan, RunWeights weights)
    : config_(config), weights_(weights), built_from_(std::chrono::steady_clock::now()) {
  const DistEnv env = DistEnv::from_environment();
  // Before the rendezvous: every rank refuses a batch it cannot split alike, where a rank
  // leaving mid-rendezvous would make the others report a lost connection instead.
  if (!config.data.train.empty()) rows_ = rows_per_rank(config, env.world_size);
  // A frozen run writes nothing: it claims no out_dir, and the checkpoints there are the
  // trained run's.
  if (!frozen()) {
    if (env.rank == 0) out_dir_lock_ = OutDirLock::claim(config);
    check_complete_checkpoints(config.checkpoint.dir);
    check_out_dir(config);
  }
  comm_ = init_distributed(env, config.parallel);
  device_ = comm_->device();
  const int rank = comm_->rank();
  // Seeded per rank, so anything random and the RNG states checkpoints save are reproducible.
  at::manual_seed(config.model.init_seed + static_cast<uint64_t>(rank));
  if (!frozen()) checkpoint_ = open_resume_checkpoint(config, env);
  require_same_settings(config, checkpoint_ ? std::optional<int64_t>(checkpoint_->step()) : std::nullopt, *comm_);
  // The data first: a bad token file is reported before the model takes its time to load.
  const ModelConfig model_config = model_config_of(config.model);
  if (!config.data.train.empty()) batches_ = open_batches(config.data, model_config);
  config.check_experts(model_config);
  // The policy reads a skeleton of the model (no memory): its units shard the run, one rank
  // or many, and its LoRA declaration puts adapters on the model before its values load.
  const auto skeleton = build_model(model_config, torch::TensorOptions().dtype(config.model.dtype).device(torch::kMeta));
  shard(build_plan(*skeleton, comm_->size(), rank));
  optimizer_ = std::make_unique<AdamW>(decay_groups(fsdp_->sharded_parameters(), config.optimizer.weight_decay),
                                       config.optimizer);
  overlaps_host_update_ = overlap_host_updates(config.optimizer, device_, *fsdp_, rank);
  scaler_ = loss_scaler(config.loss_scale, computes_float16_, frozen(), rank);
  if (routes_tokens(model().config()) && !frozen()) {
    experts_.emplace(*model().config().moe, config.experts, routing_bias_names(model()));
  }
  if (loaded_.lora && rank == 0) base_ = base_identity_of(config.model);
  model_files_ = model_files_dir(config.model);
  export_in_own_run_dir_ = in_own_run_dir(config, config.checkpoint.export_dir);
  adapter_in_own_run_dir_ = in_own_run_dir(config, config.checkpoint.adapter_dir);
  // The binary's run saves as its run file says; the Python API's saves when the loop asks.
  if (batches_ && !frozen()) check_disk_room(std::max(1, env.world_size / std::max(1, env.local_world_size)));
}

Run::~Run() = default;

size_t Run::units() const { return fsdp_->units().size(); }

void Run::shard(const Plan& plan) {
  loaded_ = load_model(config_.model, /*unallocated=*/true, plan.lora ? &*plan.lora : nullptr,
                       checkpoint_ ? checkpoint_->dir().string() : "");
  CausalLM& model = *loaded_.model;
  parameters_ = model.recursive_param_count();  // numel holds for unallocated parameters too
  // Frozen before the plan resolves: each parameter is then held in its compute dtype, with
  // no gradient or optimizer state, as a LoRA run's base is.
  if (frozen()) {
    for (auto& p : model.parameters()) p.set_requires_grad(false);
  }
  freeze_modules(plan, model);
  model.train(!frozen());
  const int rank = comm_->rank();
  const ResolvedPlan resolved = resolve_policy_plan(plan, model, comm_->size(), config_.model.dtype, config_.policy);
  require_same_plan(resolved, *comm_);
  // A tied head's weight is the embedding's, named by the path that reaches it first.
  const std::string head = model.config().tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  // The root unit is the last, where it holds a parameter at all (a plan leaves out units of none).
  const ResolvedUnit& last = resolved.units.back();
  const bool root_kept = std::count(last.declared.modules.begin(), last.declared.modules.end(), "") > 0;
  head_in_root_ = root_kept && std::any_of(last.params.begin(), last.params.end(),
                                           [&](const auto& p) { return p.name == head; });
  computes_float16_ = std::any_of(resolved.units.begin(), resolved.units.end(),
                                  [](const auto& unit) { return unit.compute_dtype == at::kHalf; });
  if (rank == 0) {
    const std::string constants = resolved.constant_param_bytes == 0 ? "" : " (" +
        std::to_string(resolved.constant_param_bytes) + " B of them frozen, held in their compute dtype)";
    log_info("plan: ", resolved.units.size(), " units; per rank: parameters ", resolved.param_bytes, " B", constants,
             ", gradients ", resolved.grad_bytes, " B, optimizer state ", resolved.optimizer_bytes, " B");
    log_info("precision: ", precision_line(resolved, master_dtype(config_.model.dtype)));
  }
  // Other adapters are said as such, before the fill meets their rows as tensors of other shapes.
  if (checkpoint_) check_same_adapters(*checkpoint_);
  // The model is placed unit by unit, each rank filling its rows.
  fsdp_ = std::make_unique<FsdpState>(model, comm_, resolved,
                                      checkpoint_ ? checkpoint_fill(checkpoint_, loaded_.fill) : loaded_.fill, device_);
  if (loaded_.weights && !checkpoint_) {
    if (rank == 0) warn_unused_hf_tensors(model, *loaded_.weights);
    // Touched pages of the mapped files, read from the kernel: what this rank really read. A
    // file's last page counts whole, past its end: the figure is held to the files' size.
    const size_t total = loaded_.weights->file_bytes();
    const size_t touched = std::min(loaded_.weights->resident_bytes(), total);
    log_info("weights: rank ", rank, " read ", touched, " of ", total, " bytes of the HF files (",
             100.0 * static_cast<double>(touched) / static_cast<double>(std::max<size_t>(total, 1)), "%)");
  }
  // The fill refused tensors of other shapes; a checkpoint of more tensors (more layers,
  // other adapters) is refused here, before the run uses any row.
  if (checkpoint_) check_fits(*checkpoint_);
  check_finite_weights();
  require_same_sources(sources_read(), *comm_);
  loaded_.fill = {};
  loaded_.weights.reset();  // unmaps the files
  log_shards(*fsdp_);
}

std::map<std::string, std::string> Run::sources_read() const {
  std::map<std::string, std::string> sources;
  const auto of_checkpoint = [](const ShardedCheckpoint& c) {
    const std::string text = c.metadata().dump();  // each file's checksum among the rest
    return format_crc32c(crc32c(text.data(), text.size()));
  };
  if (loaded_.weights) sources["[model] path's weights"] = loaded_.weights->fingerprint();
  if (ShardedCheckpoint::is_checkpoint(config_.model.path)) {
    sources["[model] path's checkpoint"] = of_checkpoint(ShardedCheckpoint::open(config_.model.path));
  }
  if (checkpoint_) sources["[checkpoint] resume's checkpoint"] = of_checkpoint(*checkpoint_);
  if (batches_) sources["[data] train's contents"] = batches_->identity().value("contents", json()).dump();
  return sources;
}

void Run::check_finite_weights() {
  // Weights of NaN or inf would train nothing: every step's gradient norm would not be finite,
  // and every update skipped. Each rank reads its own rows; one that finds any makes every rank
  // refuse the run.
  std::vector<NamedParameter> shards;
  for (const auto& s : fsdp_->shard_rows()) shards.push_back({s.name, s.rows});
  const std::string found = first_non_finite(shards);
  const std::string source = checkpoint_ ? checkpoint_->dir().string() : "[model] path " + config_.model.path;
  const std::optional<int> first = first_refusing_rank(!found.empty());
  if (!found.empty()) throw UserError(source + ": parameter '" + found + "' holds NaN or inf: the weights are not finite");
  if (first) {
    throw EveryRankError(source + ": rank " + std::to_string(*first) + " found weights of NaN or inf in its rows (its "
                         "error says which)");
  }
}

StepFigures Run::step(double lr, const std::function<bool()>& stop_requested) {
  const TrainConfig& tc = config_.train;
  config_.require_data();
  optimizer_->zero_grad();
  const double scale = scaler_ ? scaler_->scale() : 1.0;
  at::Tensor loss_sum = at::zeros({1}, at::TensorOptions(at::kDouble).device(device_));
  const int64_t step_targets = batches_->draw_step(tc.grad_accum);
  for (int64_t micro = 0; micro < tc.grad_accum; ++micro) {
    failpoint("signal-mid-step", SIGTERM);
    fsdp_->set_requires_gradient_sync(tc.sync_each_micro_batch || micro + 1 == tc.grad_accum);
    MicroBatch batch = batches_->rows(micro, comm_->rank() * rows_, rows_);
    batch.input = to_device(batch.input, device_);
    batch.target = to_device(batch.target, device_);
    batch.vision = batch.vision.to(device_);
    // The units' hooks do the communication: each unit's forward gathers its parameters
    // first (prefetching the next unit's) and frees them after, and in backward gathers them
    // again, then reduce-scatters their gradients into the owned shards' .grad.
    // Dividing by the step's global target count makes the gradient summed over ranks and
    // micro-batches that of the mean loss over the whole step.
    auto loss = next_token_loss_sum(batch.logits(model()), batch.target) / static_cast<double>(step_targets);
    if (experts_) loss = loss + experts_->micro_batch_loss(*model().routing(), *comm_, tc.grad_accum, scale);
    (scaler_ ? loss * scale : loss).backward();
    loss_sum += loss.detach().to(at::kDouble);
  }
  // The loss sum carries the stop request too, so every rank learns of the same one.
  at::Tensor reduced = at::cat({loss_sum, at::full({1}, stop_requested() ? 1.0 : 0.0, loss_sum.options())});
  comm_->all_reduce_sum(reduced);
  const GradClip clip = clip_by_norm(fsdp_->grad_groups(), tc.clip_grad_norm, scale);
  update(lr, clip);
  // The step's one wait for the device, with all of it queued: reading the loss and the norm
  // holds up no work of the step.
  enum { kLoss, kStopVotes, kGradNorm };
  const at::Tensor read = at::cat({reduced, clip.norm.to(reduced.device())}).to(at::kCPU);  // [3]
  const auto value = read.accessor<double, 1>();
  StepFigures figures{.loss = value[kLoss], .grad_norm = value[kGradNorm], .targets = step_targets,
                      .stopping = value[kStopVotes] > 0};
  if (scaler_) {
    figures.loss_scale = scale;
    scaler_->update(std::isfinite(figures.grad_norm));
  }
  if (experts_) {
    if (std::isfinite(figures.grad_norm)) experts_->update_routing_bias(*fsdp_);
    figures.experts = experts_->finish_step();
  }
  return figures;
}

void Run::update(double lr, const GradClip& clip) {
  fsdp_->reshard_all();  // the next forward must gather the updated shards
  if (!overlaps_host_update_) {
    optimizer_->step(lr, clip);
    return;
  }
  fsdp_->expect_host_updates(optimizer_->step(lr, clip, fsdp_->host_update_batches()));
}

void Run::check_trains(const char* what) const {
  if (frozen()) {
    throw EveryRankError(std::string(what) + ": the run is frozen (a reference model): its weights stay as [model] "
                         "path gave them, and it neither steps, saves nor loads");
  }
}

UpdateFigures Run::apply_gradients(double lr) {
  check_trains("step");
  check_loaded("step");
  check_outside_backward("step");
  // torch's optimizers leave a parameter without a gradient as it is: a step with none at all
  // would be weight decay alone, the mark of a forgotten backward, or of one that stopped at the
  // logits. A rank whose rows brought none steps with the others' (agreed, for all to raise).
  at::Tensor arrived = fsdp_->gradient_arrivals();  // [P]
  comm_->all_reduce_sum(arrived);
  if (arrived.sum().item<double>() == 0) {
    throw EveryRankError("step: no gradients since zero_grad (no backward through the model's units yet)");
  }
  fsdp_->drop_unarrived_gradients(arrived);
  const auto groups = fsdp_->grad_groups();
  const GradClip clip = clip_by_norm(groups, config_.train.clip_grad_norm, scaler_ ? scaler_->scale() : 1.0);
  update(lr, clip);
  const double norm = clip.norm.to(at::kCPU).item<double>();
  if (scaler_) scaler_->update(std::isfinite(norm));
  if (experts_) {
    if (std::isfinite(norm)) experts_->update_routing_bias(*fsdp_);
    experts_->finish_step();
  }
  return {.grad_norm = norm, .stepped = std::isfinite(norm)};
}

void Run::zero_grad() {
  optimizer_->zero_grad();
  fsdp_->forget_gradients();
}

std::optional<EvalResult> Run::evaluate() {
  if (!batches_ || !batches_->can_evaluate()) return std::nullopt;
  return batches_->evaluate(model(), config_.train.eval_batches * config_.data.batch_size, comm_.get());
}

}  // namespace fsdpp
