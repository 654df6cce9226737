// The training loop. Launched on several ranks it shards the model (fsdp/), gives each rank
// its rows of every global batch, and normalises the loss by the global token count, so
// the summed gradients and hence every update equal those of one process on the whole batch.
#include "train/trainer.h"

#include "core/error.h"
#include "core/log.h"
#include "fsdp/fsdp_state.h"
#include "io/hf_dir.h"
#include "train/evaluate.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cmath>

namespace fsdpp {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

void check_vocab(const TokenFile& tokens, const CausalLM& model) {
  if (tokens.vocab_size() > model.config().vocab_size) {
    throw UserError(tokens.path().string() + ": token vocabulary " + std::to_string(tokens.vocab_size()) +
                    " exceeds the model's vocab_size " + std::to_string(model.config().vocab_size));
  }
}

// Saves the full model from rank 0; with FSDP every rank takes part in the gathers.
void save_model(CausalLM& model, FsdpState* fsdp, const RunConfig& config) {
  const auto dtype = parse_dtype(config.model.dtype);
  if (fsdp == nullptr) {
    save_hf_dir(model, config.checkpoint.dir, dtype);
    return;
  }
  NamedTensors full;
  const bool writer = fsdp->world().rank() == 0;
  fsdp->for_each_full_parameter([&](const std::string& name, const at::Tensor& t) {
    if (writer) full.emplace_back(name, t.to(dtype, /*non_blocking=*/false, /*copy=*/true));
  });
  if (writer) save_hf_dir(model.config(), full, config.checkpoint.dir, dtype);
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
  if (config.data.batch_size % world != 0) {
    throw UserError(config.file.string() + ": [data] batch_size " + std::to_string(config.data.batch_size) +
                    " is not a multiple of the world size " + std::to_string(world) +
                    " (each rank takes batch_size / world sequences)");
  }
  const int64_t rows = config.data.batch_size / world;

  const TokenFile tokens = TokenFile::open(config.data.train);
  auto [model, init_pending] = load_model(config.model, /*defer_fresh_init=*/env.launched);
  check_vocab(tokens, *model);
  model->train();
  std::unique_ptr<FsdpState> fsdp;
  if (env.launched) {
    Plan plan = build_plan(*model, world, rank);
    const ResolvedPlan resolved = resolve_plan(plan, *model, world, parse_dtype(config.model.dtype));
    if (rank == 0) {
      log_info("plan: ", resolved.units.size(), " units; per rank: parameters ", resolved.param_bytes,
               " B, gradients ", resolved.grad_bytes, " B, optimizer state ", resolved.optimizer_bytes, " B");
    }
    std::optional<FreshInit> fresh;
    if (init_pending) fresh = FreshInit{config.model.init_seed, model->config().initializer_range};
    fsdp = std::make_unique<FsdpState>(*model, comm, resolved, fresh);
    // Read from the shard tensors themselves, for comparison with what `fsdpp plan` predicts.
    int64_t shard_bytes = 0;
    std::string names;
    for (const auto& unit : fsdp->units()) {
      names += (names.empty() ? "" : ",") + unit->name();
      for (const auto& p : unit->params()) shard_bytes += p.local.numel() * p.local.element_size();
    }
    log_info("sharded: ", fsdp->units().size(), " units [", names, "], parameter shards ", shard_bytes, " bytes");
  }

  const TokenRange range = train_range(config.data, tokens);
  BatchSampler sampler(tokens, range.begin, range.end, config.data.seq_len, config.data.batch_size,
                       config.data.seed);
  const TokenRange held_out = eval_range(config.data, tokens);
  const bool can_eval = tc.eval_every > 0 && config.data.eval_fraction > 0;

  const auto params = fsdp ? fsdp->sharded_parameters() : unique_named_parameters(*model);
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
  const LrSchedule schedule(config.scheduler, config.optimizer.lr, tc.steps);
  std::unique_ptr<MetricsSink> metrics;
  if (rank == 0) metrics = std::make_unique<MetricsSink>(config.metrics, config.metrics.jsonl, tc.steps);

  const int64_t step_tokens = tc.grad_accum * config.data.batch_size * config.data.seq_len;
  if (rank == 0) {
    log_info("train: ", tc.steps, " steps of ", step_tokens, " tokens (", tc.grad_accum, " x ",
             config.data.batch_size, " x ", config.data.seq_len, "), ", world, " rank(s), ",
             fsdp ? concat(fsdp->units().size(), " FSDP units, ") : std::string(), at::get_num_threads(),
             " threads per rank, ", sampler.windows_per_epoch(), " windows per epoch");
  }

  TrainSummary summary;
  const auto start = Clock::now();
  for (int64_t step = 1; step <= tc.steps; ++step) {
    const auto step_start = Clock::now();
    const double lr = schedule.at(step);
    optimizer.zero_grad();
    at::Tensor loss_sum = at::zeros({1}, at::kDouble);
    for (int64_t micro = 0; micro < tc.grad_accum; ++micro) {
      if (fsdp) fsdp->set_requires_gradient_sync(tc.sync_each_micro_batch || micro + 1 == tc.grad_accum);
      auto batch = sampler.next();  // the global batch; this rank trains on its rows
      auto input = batch.input.narrow(0, rank * rows, rows);
      auto target = batch.target.narrow(0, rank * rows, rows);
      // Dividing by the step's global token count makes the gradient summed over ranks and
      // micro-batches that of the mean loss over the whole step.
      auto loss = next_token_loss_sum((*model)(input), target) / static_cast<double>(step_tokens);
      loss.backward();
      loss_sum += loss.detach().to(at::kDouble);
    }
    comm->all_reduce_sum(loss_sum);
    const double grad_norm = clip_grad_norm(grad_groups, tc.clip_grad_norm);
    StepMetrics m;
    m.step = step;
    m.loss = loss_sum.item<double>();
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
    m.elapsed_s = seconds_since(start);
    m.tokens = step * step_tokens;
    m.tokens_per_s = static_cast<double>(step_tokens) / std::max(1e-9, seconds_since(step_start));
    if (metrics) metrics->record_step(m, step % tc.log_every == 0 || step == tc.steps || step == 1);
    summary.final_loss = m.loss;
    summary.steps = step;

    if (can_eval && (step % tc.eval_every == 0 || step == tc.steps)) {
      auto r = evaluate(*model, tokens, held_out.begin, held_out.end, config.data.seq_len,
                        config.data.batch_size, tc.eval_batches * config.data.batch_size);
      if (metrics) metrics->record_eval(step, r.loss, r.perplexity);
    }
    const bool periodic = config.checkpoint.save_every > 0 && step % config.checkpoint.save_every == 0;
    if (periodic || (config.checkpoint.save_final && step == tc.steps)) {
      save_model(*model, fsdp.get(), config);
      if (rank == 0) log_info("saved model at step ", step, " to ", config.checkpoint.dir);
    }
  }
  return summary;
}

}  // namespace fsdpp
