// The training loop. On any number of ranks, one included, it trains the model sharded by the
// policy's plan (set up in session.cpp), gives each rank its rows of every global batch, and
// normalises the loss by the step's global target count, so the summed gradients and hence
// every update equal those of one process on the whole batch.
#include "train/trainer.h"

#include "core/device.h"
#include "core/log.h"
#include "train/lr_schedule.h"
#include "train/metrics.h"
#include "train/next_token_loss.h"
#include "train/session.h"
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

// The figures of a step beyond its loss: pace, time left, memory and, with a stated peak, model
// FLOPs utilisation over every rank.
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
  }
  if (config.metrics.peak_tflops > 0) {
    m.mfu = step_flops / step_s / (config.metrics.peak_tflops * 1e12 * s.comm->size());
  }
}

// The run's shape, for the log.
void log_run(const RunConfig& config, const Session& s, int64_t step_tokens) {
  const TrainConfig& tc = config.train;
  log_info("train: ", tc.steps, " steps of ", step_tokens, " tokens (", tc.grad_accum, " x ", config.data.batch_size,
           " x ", config.data.seq_len, "), ", s.comm->size(), " rank(s), ",
           s.units, " FSDP units, ", at::get_num_threads(), " threads per rank, ",
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

// A step's figures for the log from its result; counts a skipped update in `summary`.
StepMetrics step_metrics(int64_t step, double lr, const StepResult& r, TrainSummary& summary, int rank) {
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
  return m;
}

// What follows a step when due: evaluation on the held-out batches, and a checkpoint
// (periodic, the last step's, or the one a stop signal asks for).
void after_step(const RunConfig& config, Session& s, int64_t step, bool stopping, MetricsSink* metrics,
                const json& client_state) {
  const TrainConfig& tc = config.train;
  const bool eval_due = tc.eval_every > 0 && (step % tc.eval_every == 0 || step == tc.steps);
  if (eval_due && s.batches->can_evaluate()) {
    auto e = s.batches->evaluate(*s.loaded.model, tc.eval_batches * config.data.batch_size, s.comm.get());
    if (metrics) metrics->record_eval(step, e.loss, e.perplexity);
  }
  const bool periodic = config.checkpoint.save_every > 0 && step % config.checkpoint.save_every == 0;
  const bool last = config.checkpoint.save_final && step == tc.steps;
  if (periodic || last || stopping) s.checkpointer->save(step, client_state);
}

// The run's product once every step is done: the model as an HF directory, or a LoRA run's
// adapter (the base is frozen; fsdpp export --merge-lora merges it).
void save_final(const RunConfig& config, Session& s, int64_t steps) {
  const int rank = s.comm->rank();
  if (s.loaded.lora) {
    export_adapter(*s.loaded.lora, config.model.path, *s.view, rank, config.checkpoint);
    if (rank == 0) log_info("saved the LoRA adapter at step ", steps, " to ", config.checkpoint.adapter_dir);
  } else {
    export_model(s.loaded.model->config(), *s.view, rank, config.checkpoint);
    if (rank == 0) log_info("exported the model at step ", steps, " to ", config.checkpoint.export_dir);
  }
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

  StepProfiler profiler;
  const auto start = Clock::now();
  for (int64_t step = first_step; step <= tc.steps; ++step) {
    if (step == config.metrics.profile_step) profiler.start();
    const auto step_start = Clock::now();
    const double lr = schedule.at(step);
    const StepResult r = train_step(config, s, lr);
    StepMetrics m = step_metrics(step, lr, r, summary, rank);
    if (profiler.active()) save_profile(profiler, s, tc.out_dir, step);
    measure(m, config, s, first_step, start, step_start, step_flops);
    if (metrics) metrics->record_step(m, step % tc.log_every == 0 || step == tc.steps || step == first_step);
    summary.final_loss = m.loss;
    summary.steps = step;
    const json client_state{{"skipped_steps", summary.skipped_steps}, {"tokens_seen", step * step_tokens},
                            {"loss", summary.final_loss}};
    after_step(config, s, step, r.stopping, metrics.get(), client_state);
    if (r.stopping) {
      summary.stop_signal = stop_signal != 0 ? static_cast<int>(stop_signal) : SIGTERM;
      if (rank == 0) log_warn("stopped by ", ::strsignal(summary.stop_signal), " after step ", step);
      return summary;
    }
  }
  if (config.checkpoint.save_final) save_final(config, s, summary.steps);
  return summary;
}

}  // namespace fsdpp
