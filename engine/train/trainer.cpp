// The training loop. Launched on several ranks it shards the model (fsdp/), gives each rank
// its rows of every global batch, and normalises the loss by the step's global target count,
// so the summed gradients and hence every update equal those of one process on the whole batch.
#include "train/trainer.h"

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
#include "distributed/dist_env.h"
#include "fsdp/fsdp_state.h"
#include "fsdp/whole_model.h"
#include "io/hf_dir.h"
#include "io/sharded_checkpoint.h"
#include "models/registry.h"
#include "train/run_checkpoint.h"
#include "train/evaluate.h"
#include "train/next_token_loss.h"
#include "train/expert_balance.h"
#include "train/model_source.h"
#include "train/batches.h"
#include "train/metrics.h"
#include "train/step_profiler.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>

#include <nlohmann/json.hpp>

namespace fsdpp {

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Set by SIGTERM or SIGINT; the loop finishes its step, saves and stops. The handler
// resets itself, so a second signal ends the process at once.
volatile std::sig_atomic_t stop_signal = 0;

extern "C" void on_stop_signal(int sig) { stop_signal = sig; }

void catch_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sa.sa_flags = SA_RESETHAND;
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
}

// Everything a run builds before its first step, in the order it is built.
struct Session {
  std::shared_ptr<Comm> comm;
  c10::Device device = at::kCPU;
  int64_t rows = 0;  // this rank's rows of every global micro-batch
  bool sharded = false;  // launched: the model is sharded by the policy's plan
  size_t units = 0;      // FSDP units when sharded
  int64_t parameters = 0;  // the whole model's, counted before sharding
  std::shared_ptr<const ShardedCheckpoint> checkpoint;  // the one to resume from, if any
  LoadedModel loaded;
  std::unique_ptr<ShardedView> view;  // FsdpState when launched, else WholeModel
  std::unique_ptr<Batches> batches;
  std::unique_ptr<AdamW> optimizer;
  std::unique_ptr<RunCheckpointer> checkpointer;
  std::optional<ExpertBalance> experts;  // mixture-of-experts models
};

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

// Shards the model by the policy's plan, each rank filling its rows from the checkpoint or
// the loaded weights, which are then unmapped.
std::unique_ptr<FsdpState> shard_model(const RunConfig& config, const Plan& plan, Session& s) {
  CausalLM& model = *s.loaded.model;
  const int rank = s.comm->rank(), world = s.comm->size();
  const ResolvedPlan resolved = resolve_plan(plan, model, world, parse_dtype(config.model.dtype));
  if (rank == 0) {
    const std::string constants = resolved.constant_param_bytes == 0 ? "" : " (" +
        std::to_string(resolved.constant_param_bytes) + " B of them frozen, held in their compute dtype)";
    log_info("plan: ", resolved.units.size(), " units; per rank: parameters ", resolved.param_bytes, " B", constants,
             ", gradients ", resolved.grad_bytes, " B, optimizer state ", resolved.optimizer_bytes, " B");
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

// The model (sharded when launched), its batches, the optimizer over its shards and the
// checkpointer that saves and restores all of them.
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
  // The policy reads a skeleton of the model (no memory): its units shard a launched run, and
  // its LoRA declaration puts adapters on the model of any run before its values load.
  const Plan plan = build_plan(*build_model(model_config, torch::TensorOptions().dtype(parse_dtype(config.model.dtype))
                                                              .device(torch::kMeta)),
                               s.comm->size(), rank);
  s.loaded = load_model(config.model, /*unallocated=*/env.launched, plan.lora ? &*plan.lora : nullptr);
  CausalLM& model = *s.loaded.model;
  s.parameters = model.recursive_param_count();  // numel holds for unallocated parameters too
  s.sharded = env.launched;
  if (!s.sharded) model.to(s.device);  // a sharded model is placed unit by unit instead
  model.train();
  if (s.sharded) {
    s.view = shard_model(config, plan, s);
  } else {
    s.view = std::make_unique<WholeModel>(model);
  }
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

// Restores the run from its checkpoint, returning the first step still to train.
int64_t resume(Session& s, TrainSummary& summary, Clock::time_point load_start) {
  const ResumePoint point = s.checkpointer->restore(*s.checkpoint, /*parameters_loaded=*/s.sharded);
  summary.steps = point.step;
  summary.skipped_steps = point.client_state.value("skipped_steps", int64_t{0});
  const ReadStats read = s.checkpoint->read_stats();
  log_info("resume: rank ", s.comm->rank(), " read ", read.bytes, " bytes of ", s.checkpoint->dir().string(),
           " (saved at world ", s.checkpoint->world_size(), ") in ", read.seconds, " s (",
           static_cast<double>(read.bytes) / std::max(read.seconds, 1e-9) / 1e9, " GB/s; ", seconds_since(load_start),
           " s to rebuild the run); continuing after step ", point.step);
  return point.step + 1;
}

struct StepResult {
  double loss = 0.0;       // the step's mean loss over every rank
  double grad_norm = 0.0;  // before clipping
  bool stopping = false;   // some rank caught SIGTERM or SIGINT
  std::optional<ExpertLoad> experts;  // a MoE model's routing figures
};

// One optimizer step: forward and backward over this rank's rows of each micro-batch, the
// loss divided by the step's global target count (a MoE model's load-balancing share added),
// then clipping and AdamW.
StepResult train_step(const RunConfig& config, Session& s, double lr) {
  const TrainConfig& tc = config.train;
  s.optimizer->zero_grad();
  at::Tensor loss_sum = at::zeros({1}, at::TensorOptions(at::kDouble).device(s.device));
  const int64_t step_targets = s.batches->draw_step(tc.grad_accum);
  for (int64_t micro = 0; micro < tc.grad_accum; ++micro) {
    s.view->set_requires_gradient_sync(tc.sync_each_micro_batch || micro + 1 == tc.grad_accum);
    MicroBatch batch = s.batches->rows(micro, s.comm->rank() * s.rows, s.rows);
    batch.input = to_device(batch.input, s.device);
    batch.target = to_device(batch.target, s.device);
    batch.vision = batch.vision.to(s.device);
    // Dividing by the step's global target count makes the gradient summed over ranks and
    // micro-batches that of the mean loss over the whole step.
    CausalLM& model = *s.loaded.model;
    auto loss = next_token_loss_sum(batch.logits(model), batch.target) / static_cast<double>(step_targets);
    if (s.experts) loss = loss + s.experts->micro_batch_loss(*model.routing(), *s.comm);
    loss.backward();
    loss_sum += loss.detach().to(at::kDouble);
  }
  // The loss sum carries the stop request too, so every rank sees the same one.
  at::Tensor reduced = at::cat({loss_sum, at::full({1}, stop_signal != 0 ? 1.0 : 0.0, loss_sum.options())});
  s.comm->all_reduce_sum(reduced);
  const GradClip clip = clip_by_norm(s.view->grad_groups(), tc.clip_grad_norm);
  s.view->reshard_all();  // the next forward must gather the updated shards
  s.optimizer->step(lr, clip);
  // The step's one wait for the device, with all of it queued: reading the loss and the norm
  // holds up no work of the step.
  const at::Tensor figures = at::cat({reduced, clip.norm.to(reduced.device())}).to(at::kCPU);  // [3]
  const auto f = figures.accessor<double, 1>();
  StepResult r{f[0], f[2], f[1] > 0};
  if (s.experts && std::isfinite(r.grad_norm)) s.experts->update_routing_bias(*s.view);
  if (s.experts) r.experts = s.experts->finish_step();
  return r;
}

// Training FLOPs per token: 6 per weight of every matrix product (forward and backward) plus
// attention's score and value products, 6 x layers x heads x seq_len x (query/key head size +
// value head size). The input embedding is a lookup, unless tied to the output head, which is
// a product; a token passes through K of each MoE layer's E experts only.
double flops_per_token(const ModelConfig& model, int64_t parameters, int64_t seq_len) {
  const int64_t lookup = model.tie_word_embeddings ? 0 : model.vocab_size * model.hidden_size;
  int64_t idle_experts = 0;
  if (const auto& moe = model.moe) {
    for (int64_t layer = 0; layer < model.num_hidden_layers; ++layer) {
      if (moe->is_moe_layer(layer)) {
        idle_experts += (moe->num_experts - moe->num_experts_per_tok) * 3 * model.hidden_size * moe->moe_intermediate_size;
      }
    }
  }
  const int64_t head_widths = model.query_key_head_dim() + model.value_head_dim();
  return 6.0 * static_cast<double>(parameters - lookup - idle_experts) +
         6.0 * static_cast<double>(model.num_hidden_layers * model.num_attention_heads * seq_len * head_widths);
}

// The figures of a step beyond its loss: pace, time left, memory and, on a GPU with a stated
// peak, model FLOPs utilisation over every rank.
void measure(StepMetrics& m, const RunConfig& config, const Session& s, int64_t first_step,
             Clock::time_point start, Clock::time_point step_start, double step_flops) {
  const int64_t step_tokens = config.train.grad_accum * config.data.batch_size * config.data.seq_len;
  const double step_s = std::max(1e-9, seconds_since(step_start));
  m.elapsed_s = seconds_since(start);
  m.tokens = m.step * step_tokens;
  m.tokens_per_s = static_cast<double>(step_tokens) / step_s;
  m.eta_s = m.elapsed_s / static_cast<double>(m.step - first_step + 1) * static_cast<double>(config.train.steps - m.step);
  m.host_peak_gb = host_peak_memory_gb();
  if (const auto memory = device_peak_memory(s.device)) {
    m.device_allocated_gb = memory->allocated_gb;
    m.device_reserved_gb = memory->reserved_gb;
    if (config.metrics.peak_tflops > 0) {
      m.mfu = step_flops / step_s / (config.metrics.peak_tflops * 1e12 * s.comm->size());
    }
  }
}

// The run's shape, for the log.
void log_run(const RunConfig& config, const Session& s, int64_t step_tokens) {
  const TrainConfig& tc = config.train;
  log_info("train: ", tc.steps, " steps of ", step_tokens, " tokens (", tc.grad_accum, " x ", config.data.batch_size,
           " x ", config.data.seq_len, "), ", s.comm->size(), " rank(s), ",
           s.sharded ? concat(s.units, " FSDP units, ") : std::string(), at::get_num_threads(), " threads per rank, ",
           s.batches->order().size(), " ", s.batches->item_name(), " per epoch");
}

// Writes the traced step's profile once the device has finished its work.
void save_profile(StepProfiler& profiler, const Session& s, const std::string& out_dir, int64_t step) {
  synchronize_device(s.device);
  const auto trace = std::filesystem::path(out_dir) /
                     ("profile-step-" + std::to_string(step) + "-rank-" + std::to_string(s.comm->rank()) + ".json");
  profiler.stop_and_save(trace.string());
  log_info("profile: step ", step, " traced to ", trace.string());
}

}  // namespace

TrainSummary train(const RunConfig& config, const PlanBuilder& build_plan) {
  const TrainConfig& tc = config.train;
  const auto load_start = Clock::now();
  Session s = set_up(config, build_plan);
  const int rank = s.comm->rank();
  TrainSummary summary;
  const int64_t first_step = s.checkpoint ? resume(s, summary, load_start) : 1;
  const LrSchedule schedule(config.scheduler, config.optimizer.lr, tc.steps);
  std::unique_ptr<MetricsSink> metrics;
  if (rank == 0) metrics = std::make_unique<MetricsSink>(config.metrics, tc.steps, first_step - 1);
  const int64_t step_tokens = tc.grad_accum * config.data.batch_size * config.data.seq_len;
  const double step_flops = static_cast<double>(step_tokens) *
                            flops_per_token(s.loaded.model->config(), s.parameters, config.data.seq_len);
  if (rank == 0) log_run(config, s, step_tokens);
  if (config.checkpoint.save_on_signal) catch_stop_signals();
  auto client_state = [&](int64_t step) {
    return json{{"skipped_steps", summary.skipped_steps}, {"tokens_seen", step * step_tokens},
                {"loss", summary.final_loss}};
  };

  StepProfiler profiler;
  const auto start = Clock::now();
  for (int64_t step = first_step; step <= tc.steps; ++step) {
    if (step == config.metrics.profile_step) profiler.start();
    const auto step_start = Clock::now();
    const double lr = schedule.at(step);
    const StepResult r = train_step(config, s, lr);
    StepMetrics m{.step = step, .loss = r.loss, .lr = lr, .grad_norm = r.grad_norm};
    if (r.experts) {
      m.aux_loss = r.experts->aux_loss;
      m.expert_load = r.experts->max_over_mean;
    }
    if (!std::isfinite(r.grad_norm)) {
      m.skipped = true;
      ++summary.skipped_steps;
      if (rank == 0) log_warn("step ", step, ": gradient norm is ", r.grad_norm, "; update skipped");
    }
    if (profiler.active()) save_profile(profiler, s, tc.out_dir, step);
    measure(m, config, s, first_step, start, step_start, step_flops);
    if (metrics) metrics->record_step(m, step % tc.log_every == 0 || step == tc.steps || step == first_step);
    summary.final_loss = m.loss;
    summary.steps = step;

    const bool eval_due = tc.eval_every > 0 && (step % tc.eval_every == 0 || step == tc.steps);
    if (eval_due && s.batches->can_evaluate()) {
      auto e = s.batches->evaluate(*s.loaded.model, tc.eval_batches * config.data.batch_size, s.comm.get());
      if (metrics) metrics->record_eval(step, e.loss, e.perplexity);
    }
    const bool periodic = config.checkpoint.save_every > 0 && step % config.checkpoint.save_every == 0;
    const bool last = config.checkpoint.save_final && step == tc.steps;
    if (periodic || last || r.stopping) s.checkpointer->save(step, client_state(step));
    if (r.stopping) {
      summary.stop_signal = stop_signal != 0 ? static_cast<int>(stop_signal) : SIGTERM;
      if (rank == 0) log_warn("stopped by ", ::strsignal(summary.stop_signal), " after step ", step);
      return summary;
    }
  }
  if (config.checkpoint.save_final && s.loaded.lora) {
    // The base is frozen: what the run made is its adapter (fsdpp export --merge-lora merges it).
    export_adapter(*s.loaded.lora, config.model.path, *s.view, rank, config.checkpoint);
    if (rank == 0) log_info("saved the LoRA adapter at step ", summary.steps, " to ", config.checkpoint.adapter_dir);
  } else if (config.checkpoint.save_final) {
    export_model(s.loaded.model->config(), *s.view, rank, config.checkpoint);
    if (rank == 0) log_info("exported the model at step ", summary.steps, " to ", config.checkpoint.export_dir);
  }
  return summary;
}

}  // namespace fsdpp
