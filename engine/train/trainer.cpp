// The training loop. Launched on several ranks it shards the model (fsdp/), gives each rank
// its rows of every global batch, and normalises the loss by the global token count, so
// the summed gradients and hence every update equal those of one process on the whole batch.
#include "train/trainer.h"

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
#include "distributed/dist_env.h"
#include "fsdp/fsdp_state.h"
#include "io/hf_dir.h"
#include "io/sharded_checkpoint.h"
#include "train/run_checkpoint.h"
#include "train/evaluate.h"
#include "train/model_source.h"
#include "train/multimodal_data.h"
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

void check_vocab(const TokenFile& tokens, const CausalLM& model) {
  if (tokens.vocab_size() > model.config().vocab_size) {
    throw UserError(tokens.path().string() + ": token vocabulary " + std::to_string(tokens.vocab_size()) +
                    " exceeds the model's vocab_size " + std::to_string(model.config().vocab_size));
  }
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

}  // namespace

TokenRange train_range(const DataConfig& data, const TokenFile& tokens) {
  const auto held_out = static_cast<int64_t>(static_cast<double>(tokens.size()) * data.eval_fraction);
  return {0, tokens.size() - held_out};
}

TokenRange eval_range(const DataConfig& data, const TokenFile& tokens) {
  if (data.eval_fraction <= 0) return {0, tokens.size()};
  return {train_range(data, tokens).end, tokens.size()};
}

TrainSummary train(const RunConfig& config, const PlanBuilder& build_plan) {
  const TrainConfig& tc = config.train;
  const DistEnv env = DistEnv::from_environment();
  auto comm = init_distributed(env, config.parallel);
  const int rank = comm->rank(), world = comm->size();
  const c10::Device device = comm->device();
  if (config.data.batch_size % world != 0) {
    throw UserError(config.file.string() + ": [data] batch_size " + std::to_string(config.data.batch_size) +
                    " is not a multiple of the world size " + std::to_string(world) +
                    " (each rank takes batch_size / world sequences)");
  }
  const int64_t rows = config.data.batch_size / world;
  // Seeded per rank, so anything random and the RNG states checkpoints save are reproducible.
  at::manual_seed(config.model.init_seed + static_cast<uint64_t>(rank));

  // A directory is a multimodal dataset (train/multimodal_data.h), a file a token file.
  const bool multimodal = std::filesystem::is_directory(config.data.train);
  std::optional<TokenFile> tokens;
  if (!multimodal) tokens = TokenFile::open(config.data.train);
  std::shared_ptr<const ShardedCheckpoint> checkpoint;
  if (auto path = resume_path(config.checkpoint)) {
    checkpoint = std::make_shared<const ShardedCheckpoint>(ShardedCheckpoint::open(*path));
  } else if (config.checkpoint.resume == "latest" && rank == 0) {
    log_info("resume: no checkpoint in ", config.checkpoint.dir, " yet; starting fresh");
  }
  const auto load_start = Clock::now();
  auto loaded = load_model(config.model, /*unallocated=*/env.launched);
  CausalLM& model = *loaded.model;
  if (!env.launched) model.to(device);  // a sharded model is placed unit by unit instead
  std::optional<MultimodalDataset> samples;
  auto* vision_language = dynamic_cast<VisionLanguageLM*>(&model);
  if (multimodal) {
    samples = MultimodalDataset::open(config.data.train, model.config(), config.data.seq_len);
  } else {
    check_vocab(*tokens, model);
  }
  model.train();
  std::unique_ptr<FsdpState> fsdp;
  if (env.launched) {
    Plan plan = build_plan(model, world, rank);
    const ResolvedPlan resolved = resolve_plan(plan, model, world, parse_dtype(config.model.dtype));
    if (rank == 0) {
      log_info("plan: ", resolved.units.size(), " units; per rank: parameters ", resolved.param_bytes,
               " B, gradients ", resolved.grad_bytes, " B, optimizer state ", resolved.optimizer_bytes, " B");
    }
    fsdp = std::make_unique<FsdpState>(model, comm, resolved,
                                       checkpoint ? checkpoint_fill(checkpoint) : loaded.fill, device);
    if (loaded.weights && !checkpoint) {
      if (rank == 0) warn_unused_hf_tensors(model, *loaded.weights);
      // Touched pages of the mapped files, read from the kernel: what this rank really read.
      const size_t touched = loaded.weights->resident_bytes(), total = loaded.weights->file_bytes();
      log_info("weights: rank ", rank, " read ", touched, " of ", total, " bytes of the HF files (",
               100.0 * static_cast<double>(touched) / static_cast<double>(std::max<size_t>(total, 1)), "%)");
    }
    loaded.fill = {};
    loaded.weights.reset();  // unmaps the files
    // Read from the shard tensors themselves, for comparison with what `fsdpp plan` predicts.
    int64_t shard_bytes = 0;
    std::string names;
    for (const auto& unit : fsdp->units()) {
      names += (names.empty() ? "" : ",") + unit->name();
      for (const auto& p : unit->params()) shard_bytes += p.local.numel() * p.local.element_size();
    }
    log_info("sharded: ", fsdp->units().size(), " units [", names, "], parameter shards ", shard_bytes, " bytes");
  }

  const TokenRange range = multimodal ? TokenRange{0, samples->size()} : train_range(config.data, *tokens);
  std::optional<BatchSampler> sampler;
  std::optional<ShuffledOrder> sample_order;
  ShuffledOrder& order = multimodal ? sample_order.emplace(samples->size(), config.data.seed, config.data.shuffle)
                                    : sampler.emplace(*tokens, range.begin, range.end, config.data.seq_len,
                                                      config.data.batch_size, config.data.seed, config.data.shuffle)
                                          .order();
  const TokenRange held_out = multimodal ? TokenRange{} : eval_range(config.data, *tokens);
  const bool can_eval = !multimodal && tc.eval_every > 0 && config.data.eval_fraction > 0;

  const auto params = fsdp ? fsdp->sharded_parameters() : unique_named_parameters(model);
  AdamW optimizer(decay_groups(params, config.optimizer.weight_decay), config.optimizer);
  std::vector<GradGroup> grad_groups;
  if (fsdp) {
    grad_groups = fsdp->grad_groups();
  } else {
    grad_groups.push_back({});
    for (const auto& group : optimizer.groups()) {
      grad_groups[0].params.insert(grad_groups[0].params.end(), group.params.begin(), group.params.end());
    }
  }
  const json data_stream = {{"train", std::filesystem::absolute(config.data.train).lexically_normal().string()},
                            {"tokens", multimodal ? samples->size() : tokens->size()}, {"begin", range.begin},
                            {"end", range.end}, {"shuffle", config.data.shuffle},
                            {"seq_len", config.data.seq_len}, {"seed", config.data.seed},
                            {"batch_size", config.data.batch_size}};
  RunCheckpointer checkpointer(config, model.config(), comm, fsdp ? fsdp->shard_rows() : whole_shard_rows(model),
                               fsdp ? fsdp->mesh_shapes() : std::vector<std::string>{"1x1"}, optimizer, order,
                               data_stream);
  TrainSummary summary;
  int64_t first_step = 1;
  if (checkpoint) {
    const ResumePoint point = checkpointer.restore(*checkpoint, /*parameters_loaded=*/fsdp != nullptr);
    first_step = point.step + 1;
    summary.steps = point.step;
    summary.skipped_steps = point.client_state.value("skipped_steps", int64_t{0});
    const ReadStats read = checkpoint->read_stats();
    log_info("resume: rank ", rank, " read ", read.bytes, " bytes of ", checkpoint->dir().string(), " (saved at world ",
             checkpoint->world_size(), ") in ", read.seconds, " s (",
             static_cast<double>(read.bytes) / std::max(read.seconds, 1e-9) / 1e9, " GB/s; ", seconds_since(load_start),
             " s to rebuild the run); continuing after step ", point.step);
  }
  const LrSchedule schedule(config.scheduler, config.optimizer.lr, tc.steps);
  std::unique_ptr<MetricsSink> metrics;
  if (rank == 0) {
    metrics = std::make_unique<MetricsSink>(config.metrics, config.metrics.jsonl, tc.steps, first_step - 1);
  }

  const int64_t step_tokens = tc.grad_accum * config.data.batch_size * config.data.seq_len;
  if (rank == 0) {
    log_info("train: ", tc.steps, " steps of ", step_tokens, " tokens (", tc.grad_accum, " x ",
             config.data.batch_size, " x ", config.data.seq_len, "), ", world, " rank(s), ",
             fsdp ? concat(fsdp->units().size(), " FSDP units, ") : std::string(), at::get_num_threads(),
             " threads per rank, ", order.size(), multimodal ? " samples" : " windows", " per epoch");
  }
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
    optimizer.zero_grad();
    at::Tensor loss_sum = at::zeros({1}, at::TensorOptions(at::kDouble).device(device));
    // Multimodal steps draw every micro-batch's global samples first: the loss divides by all
    // the targets they hold, which vary with padding and placeholders.
    std::vector<std::vector<int64_t>> step_samples(multimodal ? tc.grad_accum : 0);
    int64_t step_targets = step_tokens;
    if (multimodal) {
      step_targets = 0;
      for (auto& micro : step_samples) {
        for (int64_t i = 0; i < config.data.batch_size; ++i) micro.push_back(order.next());
        step_targets += samples->target_count(micro);
      }
      step_targets = std::max<int64_t>(step_targets, 1);
    }
    for (int64_t micro = 0; micro < tc.grad_accum; ++micro) {
      if (fsdp) fsdp->set_requires_gradient_sync(tc.sync_each_micro_batch || micro + 1 == tc.grad_accum);
      at::Tensor logits, target;
      if (multimodal) {  // this rank's rows of the global batch, with their images and videos
        const auto& all = step_samples[static_cast<size_t>(micro)];
        auto batch = samples->batch({all.begin() + rank * rows, all.begin() + (rank + 1) * rows});
        logits = (*vision_language)(batch.input.to(device), batch.vision.to(device));
        target = batch.target.to(device);
      } else {
        auto batch = sampler->next();  // the global batch; this rank trains on its rows
        logits = model(batch.input.narrow(0, rank * rows, rows).to(device));
        target = batch.target.narrow(0, rank * rows, rows).to(device);
      }
      // Dividing by the step's global target count makes the gradient summed over ranks and
      // micro-batches that of the mean loss over the whole step.
      auto loss = next_token_loss_sum(logits, target) / static_cast<double>(step_targets);
      loss.backward();
      loss_sum += loss.detach().to(at::kDouble);
    }
    // The loss sum carries the stop request too, so every rank sees the same one.
    at::Tensor reduced = at::cat({loss_sum, at::full({1}, stop_signal != 0 ? 1.0 : 0.0, loss_sum.options())});
    comm->all_reduce_sum(reduced);
    const bool stopping = reduced[1].item<double>() > 0;
    const double grad_norm = clip_grad_norm(grad_groups, tc.clip_grad_norm);
    StepMetrics m;
    m.step = step;
    m.loss = reduced[0].item<double>();
    m.lr = lr;
    m.grad_norm = grad_norm;
    if (std::isfinite(grad_norm)) {
      if (fsdp) fsdp->reshard_all();  // the next forward must gather the updated shards
      optimizer.step(lr);
    } else {
      m.skipped = true;
      ++summary.skipped_steps;
      if (rank == 0) log_warn("step ", step, ": gradient norm is ", grad_norm, "; update skipped");
    }
    if (profiler.active()) {
      synchronize_device(device);
      const auto trace = std::filesystem::path(tc.out_dir) /
                         ("profile-step-" + std::to_string(step) + "-rank-" + std::to_string(rank) + ".json");
      profiler.stop_and_save(trace.string());
      log_info("profile: step ", step, " traced to ", trace.string());
    }
    m.elapsed_s = seconds_since(start);
    m.tokens = step * step_tokens;
    m.tokens_per_s = static_cast<double>(step_tokens) / std::max(1e-9, seconds_since(step_start));
    if (metrics) metrics->record_step(m, step % tc.log_every == 0 || step == tc.steps || step == first_step);
    summary.final_loss = m.loss;
    summary.steps = step;

    if (can_eval && (step % tc.eval_every == 0 || step == tc.steps)) {
      auto r = evaluate(model, *tokens, held_out.begin, held_out.end, config.data.seq_len,
                        config.data.batch_size, tc.eval_batches * config.data.batch_size, comm.get());
      if (metrics) metrics->record_eval(step, r.loss, r.perplexity);
    }
    const bool periodic = config.checkpoint.save_every > 0 && step % config.checkpoint.save_every == 0;
    const bool last = config.checkpoint.save_final && step == tc.steps;
    if (periodic || last || stopping) checkpointer.save(step, client_state(step));
    if (stopping) {
      summary.stop_signal = stop_signal != 0 ? static_cast<int>(stop_signal) : SIGTERM;
      if (rank == 0) log_warn("stopped by ", ::strsignal(summary.stop_signal), " after step ", step);
      return summary;
    }
  }
  if (config.checkpoint.save_final) {
    export_model(model, fsdp.get(), config.checkpoint);
    if (rank == 0) log_info("exported the model at step ", summary.steps, " to ", config.checkpoint.export_dir);
  }
  return summary;
}

}  // namespace fsdpp
