// The training loop: a Run stepped from its first step still to train to the last, with the
// figures, evaluations, saves and stops around each step.
#include "run/train_loop.h"

#include "core/device.h"
#include "core/error.h"
#include "core/failpoint.h"
#include "core/log.h"
#include "core/module_tree.h"
#include "data/data.h"
#include "metrics/metrics.h"
#include "metrics/op_count.h"
#include "metrics/step_profiler.h"
#include "optim/lr_schedule.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <ctime>
#include <fstream>
#include <limits>
#include <string_view>

namespace fsdpp {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Set by SIGTERM or SIGINT; the loop finishes its step, saves and stops. A second stop of
// either ends the process at once.
volatile std::sig_atomic_t stop_signal = 0;
// The stops this process was told of: those sent to it directly, and the highest number of
// those its launcher passed on (fsdpp launch numbers each: RankProcess::signal). A job's
// scheduler signals the launcher and every rank alike, so one stop arrives twice, once each
// way: it is the larger count, not the sum, that says a second stop was asked for.
volatile std::sig_atomic_t direct_stops = 0;
volatile std::sig_atomic_t launcher_stops = 0;
// When it arrived (CLOCK_REALTIME, in ns, comparable across nodes), to tell which rank's came
// first where several ranks caught one.
std::atomic<int64_t> stop_arrival_ns{0};
static_assert(std::atomic<int64_t>::is_always_lock_free, "set in a signal handler");

// Set once the last step is saved and the export at the end runs.
volatile std::sig_atomic_t exporting = 0;

// Says so at once, where the saved step may be minutes away (write(2), clock_gettime(2),
// getppid(2), sigaction(2) and raise(3) alone are safe here).
extern "C" void on_stop_signal(int sig, siginfo_t* info, void*) {
  const bool passed_on = info != nullptr && info->si_code == SI_QUEUE && info->si_pid == ::getppid();
  const int direct = direct_stops + (passed_on ? 0 : 1), launched_before = launcher_stops;
  const int launched = passed_on ? std::max(launched_before, info->si_value.sival_int) : launched_before;
  direct_stops = direct;
  launcher_stops = launched;
  if (std::max(direct, launched) >= 2) {  // a second stop: at once, unsaved
    struct sigaction fallback {};
    fallback.sa_handler = SIG_DFL;
    ::sigaction(sig, &fallback, nullptr);
    ::raise(sig);  // delivered as the handler returns, with the default action
    return;
  }
  if (stop_signal != 0) return;  // the first stop, told the other way too
  timespec now{};
  ::clock_gettime(CLOCK_REALTIME, &now);  // async-signal-safe
  stop_arrival_ns = int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec;
  stop_signal = sig;
  static constexpr std::string_view kStep =
      ": finishing the step in flight and saving it; a second signal stops at once, unsaved\n";
  static constexpr std::string_view kExport =
      ": finishing the export at the end; a second signal stops at once, with no export\n";
  const std::string_view name = sig == SIGTERM ? "fsdpp: SIGTERM" : "fsdpp: SIGINT";
  const std::string_view rest = exporting ? kExport : kStep;
  char line[160];  // one write, so that the line reaches a launcher's reader whole
  std::memcpy(line, name.data(), name.size());
  std::memcpy(line + name.size(), rest.data(), rest.size());
  [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, line, name.size() + rest.size());
}

void catch_stop_signals() {
  struct sigaction sa {};
  sa.sa_sigaction = on_stop_signal;
  sa.sa_flags = SA_SIGINFO;
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
}

// The weights of `model` that take no gradient: a LoRA run's base, [policy.options] freeze.
int64_t frozen_parameters(Module& model) {
  int64_t frozen = 0;
  for (const auto& p : unique_named_parameters(model)) frozen += p.tensor.requires_grad() ? 0 : p.tensor.numel();
  return frozen;
}

// Training FLOPs per token: 6 per weight of every matrix product (forward and backward) plus
// attention's score and value products, 6 x layers x heads x seq_len x (query/key head size +
// value head size). The input embedding is a lookup, unless tied to the output head, which is
// a product; a token passes through K of each MoE layer's E experts only. A frozen weight (a
// LoRA base) takes 4, its forward and its input's gradient, with no gradient of its own: the
// weights count 6 less 2 for the frozen share of them.
double flops_per_token(const ModelConfig& model, int64_t parameters, int64_t frozen, int64_t seq_len) {
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
  const double per_weight = 6.0 - 2.0 * static_cast<double>(frozen) / static_cast<double>(std::max<int64_t>(parameters, 1));
  return per_weight * static_cast<double>(parameters - lookup - idle_experts) +
         6.0 * static_cast<double>(model.num_hidden_layers * model.num_attention_heads * seq_len * head_widths);
}

// The figures of a step beyond its loss: pace, time left, memory and, with a stated peak, model
// FLOPs utilisation over every rank.
void measure(StepMetrics& m, Run& run, int64_t first_step, Clock::time_point start, Clock::time_point step_start,
             double step_flops) {
  const RunConfig& config = run.config();
  const int64_t step_tokens = config.train.grad_accum * config.data.batch_size * config.data.seq_len;
  const double step_s = std::max(1e-9, seconds_since(step_start));
  m.elapsed_s = seconds_since(start);
  m.tokens_per_s = static_cast<double>(step_tokens) / step_s;
  m.eta_s = m.elapsed_s / static_cast<double>(m.step - first_step + 1) * static_cast<double>(config.train.steps - m.step);
  m.host_peak_gb = host_peak_memory_gb();
  if (const auto memory = device_peak_memory(run.device())) {
    m.device_allocated_gb = memory->allocated_gb;
    m.device_reserved_gb = memory->reserved_gb;
  }
  if (config.metrics.peak_tflops > 0) {
    m.mfu = step_flops / step_s / (config.metrics.peak_tflops * 1e12 * run.comm().size());
  }
}

// The run's shape, for the log.
void log_run(Run& run, int64_t step_tokens) {
  const RunConfig& config = run.config();
  const TrainConfig& tc = config.train;
  log_info("train: ", tc.steps, " steps of ", step_tokens, " tokens (", tc.grad_accum, " x ", config.data.batch_size,
           " x ", config.data.seq_len, "), ", run.comm().size(), " rank(s), ", run.units(), " FSDP units, ",
           at::get_num_threads(), " threads per rank, ", run.batches().order().size(), " ", run.batches().item_name(),
           " per epoch");
  // Beside other runs each writes a metrics file of its own settings: which is this one's.
  if (tc.reuse_out_dir) log_info("metrics: ", config.metrics.jsonl);
  if (const int64_t positions = run.model().config().max_position_embeddings; config.data.seq_len > positions) {
    log_warn("data: seq_len ", config.data.seq_len, " is longer than the model's max_position_embeddings ", positions,
             ": positions past it are ones the model was not made for");
  }
  const auto per_epoch = static_cast<int64_t>(run.batches().order().size());
  if (per_epoch < config.data.batch_size) {
    log_warn("data: ", per_epoch, " ", run.batches().item_name(), " per epoch cannot fill a batch of ",
             config.data.batch_size, " rows without repeats: each batch holds some of them twice or more");
  }
}

// Writes the traced step's profile once the device has finished its work.
void save_profile(StepProfiler& profiler, Run& run, int64_t step) {
  synchronize_device(run.device());
  const auto trace = std::filesystem::path(run.config().train.out_dir) /
                     ("profile-step-" + std::to_string(step) + "-rank-" + std::to_string(run.comm().rank()) + ".json");
  profiler.stop_and_save(trace.string());
  log_info("profile: step ", step, " traced to ", trace.string());
}

// Writes the counted step's kernels and bytes, per operator, and logs the totals.
void save_op_counts(const OpCounts& counts, Run& run, int64_t step) {
  const auto path = std::filesystem::path(run.config().train.out_dir) /
                    ("ops-step-" + std::to_string(step) + "-rank-" + std::to_string(run.comm().rank()) + ".json");
  std::filesystem::create_directories(path.parent_path());
  std::ofstream(path) << counts.json() << '\n';
  if (run.comm().rank() != 0) return;
  log_info("ops: step ", step, " launched ", counts.kernels, " kernels (", counts.matmul_kernels,
           " matrix products, ", counts.attention_kernels, " attention); the other ", counts.other_kernels(),
           " read and wrote ",
           std::round(static_cast<double>(counts.other_bytes) / (1 << 20) * 10) / 10, " MiB; per operator in ", path.string());
}

// A step's figures for the log; counts a skipped update in `summary`.
StepMetrics step_metrics(int64_t step, double lr, const StepFigures& f, TrainSummary& summary, int rank) {
  StepMetrics m{.step = step, .loss = f.loss, .lr = lr, .grad_norm = f.grad_norm, .targets = f.targets,
                .loss_scale = f.loss_scale};
  if (f.experts) {
    m.aux_loss = f.experts->aux_loss;
    m.expert_load = f.experts->max_over_mean;
  }
  if (!std::isfinite(f.grad_norm)) {
    m.skipped = true;
    ++summary.skipped_steps;
    if (rank == 0) log_warn("step ", step, ": gradient norm is ", f.grad_norm, "; update skipped");
  }
  return m;
}

// Whether any rank caught a stop signal: every rank votes, so that all stop after one step.
bool stop_voted(Run& run) {
  at::Tensor votes = at::full({1}, stop_signal != 0 ? 1.0 : 0.0, at::TensorOptions(at::kDouble).device(run.device()));
  run.comm().all_reduce_sum(votes);
  return votes.item<double>() > 0;
}

// The signal the ranks stop for, the same on every rank (a collective, run once all of them
// stop): the first to arrive at any of them. A rank whose peers alone were signalled would
// otherwise exit as if by SIGTERM, whatever the user sent.
int agreed_stop_signal(Run& run) {
  Comm& comm = run.comm();
  enum { kSignal, kArrival };
  at::Tensor caught = at::zeros({comm.size(), 2}, at::kLong);
  caught[comm.rank()][kSignal] = static_cast<int64_t>(stop_signal);
  caught[comm.rank()][kArrival] = stop_arrival_ns.load();
  comm.all_reduce_sum(caught);  // [ranks, 2]: each rank's row is its own
  const auto rows = caught.accessor<int64_t, 2>();
  int first = SIGTERM;  // a stop no rank caught a signal for: the launcher's gone (PR_SET_PDEATHSIG)
  int64_t first_at = std::numeric_limits<int64_t>::max();
  for (int64_t r = 0; r < rows.size(0); ++r) {
    if (rows[r][kSignal] != 0 && rows[r][kArrival] < first_at) {
      first = static_cast<int>(rows[r][kSignal]);
      first_at = rows[r][kArrival];
    }
  }
  return first;
}

// What follows a step when due: evaluation on the held-out batches, and a checkpoint
// (periodic, the last step's, or the one a stop signal asks for). Returns whether the run
// stops after this step: `stopping`, or a signal that arrived during the evaluation or the
// save, whose length the ranks would otherwise spend on another step and another save.
bool after_step(Run& run, int64_t step, bool stopping, MetricsSink* metrics, const ClientState& state) {
  const RunConfig& config = run.config();
  const TrainConfig& tc = config.train;
  // Once the ranks are past the evaluation or the save: a stop asked meanwhile, voted.
  const auto asked_meanwhile = [&] { return config.checkpoint.save_on_signal && step < tc.steps && stop_voted(run); };
  const bool periodic = config.checkpoint.save_every > 0 && step % config.checkpoint.save_every == 0;
  const bool saving = periodic || (config.checkpoint.save_final && step == tc.steps);
  if (tc.eval_every > 0 && (step % tc.eval_every == 0 || step == tc.steps)) {
    failpoint("signal-mid-eval", SIGTERM);
    if (const auto e = run.evaluate(); e && metrics) metrics->record_eval(step, e->loss, e->perplexity);
    // A save follows anyway: its vote counts this one's signals too.
    if (!stopping && !saving) stopping = asked_meanwhile();
  }
  if (saving || stopping) {
    failpoint("signal-mid-save", SIGINT);
    run.save(step, state, config.checkpoint.dir);
    // The step is saved: a signal during the save stops here, not after the next step's save.
    if (!stopping) stopping = asked_meanwhile();
  }
  return stopping;
}

}  // namespace

TrainSummary train(const RunConfig& config, const PlanBuilder& build_plan) {
  const TrainConfig& tc = config.train;
  if (config.metrics.profile_step > 0) StepProfiler::quiet_without_gpu();
  Run run(config, build_plan);
  const int rank = run.comm().rank();
  TrainSummary summary;
  const ResumePoint resumed = run.resume();
  if (resumed.step > tc.steps) {
    throw UserError(config.source.where("train", "steps") + ": [train] steps = " + std::to_string(tc.steps) +
                    " ends before step " + std::to_string(resumed.step) + ", where the checkpoint it resumes stands: "
                    "nothing is left to train; set steps past it, or write the model out with fsdpp export");
  }
  summary.steps = resumed.step;
  summary.skipped_steps = resumed.state.skipped_steps;
  summary.final_loss = resumed.state.loss;  // a resume at the last step trains none
  const int64_t first_step = resumed.step + 1;
  const LrSchedule schedule(config.scheduler, config.optimizer.lr, tc.steps);
  std::unique_ptr<MetricsSink> metrics;
  if (rank == 0) metrics = std::make_unique<MetricsSink>(config.metrics, tc.steps, first_step - 1);
  const int64_t step_tokens = tc.grad_accum * config.data.batch_size * config.data.seq_len;
  // Counted from the run's start, at the batch each step had: a resume may change the batch.
  // A checkpoint that counted none (a Python loop's save) is taken at this run's batch.
  const int64_t tokens_at_resume =
      resumed.state.tokens_seen > 0 || resumed.step == 0 ? resumed.state.tokens_seen : resumed.step * step_tokens;
  const double step_flops = static_cast<double>(step_tokens) *
                            flops_per_token(run.model().config(), run.parameters(), frozen_parameters(run.model()),
                                            config.data.seq_len);
  if (rank == 0) log_run(run, step_tokens);
  if (config.checkpoint.save_on_signal) catch_stop_signals();

  StepProfiler profiler;
  const auto start = Clock::now();
  for (int64_t step = first_step; step <= tc.steps; ++step) {
    if (step == config.metrics.profile_step) profiler.start();
    std::optional<OpCounter> counter;
    if (step == config.metrics.count_step) counter.emplace();
    const auto step_start = Clock::now();
    const double lr = schedule.at(step);
    const StepFigures f = run.step(lr, [] { return stop_signal != 0; });
    StepMetrics m = step_metrics(step, lr, f, summary, rank);
    if (counter) save_op_counts(counter->stop(), run, step);
    if (profiler.active()) save_profile(profiler, run, step);
    m.tokens = tokens_at_resume + (step - resumed.step) * step_tokens;
    measure(m, run, first_step, start, step_start, step_flops);
    if (metrics) metrics->record_step(m, step % tc.log_every == 0 || step == tc.steps || step == first_step);
    summary.final_loss = m.loss;
    summary.steps = step;
    const bool stopping =
        after_step(run, step, f.stopping, metrics.get(),
                   {.skipped_steps = summary.skipped_steps, .tokens_seen = m.tokens, .loss = m.loss});
    if (stopping) {
      summary.stop_signal = agreed_stop_signal(run);
      if (rank == 0) log_warn("stopped by ", ::strsignal(summary.stop_signal), " after step ", step);
      return summary;
    }
  }
  if (config.checkpoint.save_final) {
    exporting = 1;
    run.export_final(summary.steps);
  }
  return summary;
}

}  // namespace fsdpp
