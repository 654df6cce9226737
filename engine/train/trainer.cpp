// The training loop.
#include "train/trainer.h"

#include "core/error.h"
#include "core/log.h"
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

}  // namespace

TokenRange train_range(const DataConfig& data, const TokenFile& tokens) {
  const auto held_out = static_cast<int64_t>(static_cast<double>(tokens.size()) * data.eval_fraction);
  return {0, tokens.size() - held_out};
}

TokenRange eval_range(const DataConfig& data, const TokenFile& tokens) {
  if (data.eval_fraction <= 0) return {0, tokens.size()};
  return {train_range(data, tokens).end, tokens.size()};
}

TrainSummary train(const RunConfig& config) {
  const TrainConfig& tc = config.train;
  const TokenFile tokens = TokenFile::open(config.data.train);
  auto model = load_model(config.model);
  check_vocab(tokens, *model);
  model->train();

  const TokenRange range = train_range(config.data, tokens);
  BatchSampler sampler(tokens, range.begin, range.end, config.data.seq_len, config.data.batch_size,
                       config.data.seed);
  const TokenRange held_out = eval_range(config.data, tokens);
  const bool can_eval = tc.eval_every > 0 && config.data.eval_fraction > 0;

  const auto params = unique_named_parameters(*model);
  AdamW optimizer(decay_groups(params, config.optimizer.weight_decay), config.optimizer);
  std::vector<at::Tensor> trainable;
  for (const auto& group : optimizer.groups()) trainable.insert(trainable.end(), group.params.begin(), group.params.end());
  const LrSchedule schedule(config.scheduler, config.optimizer.lr, tc.steps);
  MetricsSink metrics(config.metrics, config.metrics.jsonl, tc.steps);

  const int64_t step_tokens = tc.grad_accum * config.data.batch_size * config.data.seq_len;
  log_info("train: ", tc.steps, " steps of ", step_tokens, " tokens (", tc.grad_accum, " x ",
           config.data.batch_size, " x ", config.data.seq_len, "), ", at::get_num_threads(),
           " threads, ", sampler.windows_per_epoch(), " windows per epoch");

  TrainSummary summary;
  const auto start = Clock::now();
  for (int64_t step = 1; step <= tc.steps; ++step) {
    const auto step_start = Clock::now();
    const double lr = schedule.at(step);
    optimizer.zero_grad();
    at::Tensor loss_sum = at::zeros({}, at::kFloat);
    for (int64_t micro = 0; micro < tc.grad_accum; ++micro) {
      auto batch = sampler.next();
      // Dividing by the step's token count makes the summed gradient that of the mean loss.
      auto loss = next_token_loss_sum((*model)(batch.input), batch.target) / static_cast<double>(step_tokens);
      loss.backward();
      loss_sum += loss.detach();
    }
    const double grad_norm = clip_grad_norm(trainable, tc.clip_grad_norm);
    StepMetrics m;
    m.step = step;
    m.loss = loss_sum.item<double>();
    m.lr = lr;
    m.grad_norm = grad_norm;
    if (std::isfinite(grad_norm)) {
      optimizer.step(lr);
    } else {
      m.skipped = true;
      ++summary.skipped_steps;
      log_warn("step ", step, ": gradient norm is ", grad_norm, "; update skipped");
    }
    m.elapsed_s = seconds_since(start);
    m.tokens = step * step_tokens;
    m.tokens_per_s = static_cast<double>(step_tokens) / std::max(1e-9, seconds_since(step_start));
    metrics.record_step(m, step % tc.log_every == 0 || step == tc.steps || step == 1);
    summary.final_loss = m.loss;
    summary.steps = step;

    if (can_eval && (step % tc.eval_every == 0 || step == tc.steps)) {
      auto r = evaluate(*model, tokens, held_out.begin, held_out.end, config.data.seq_len,
                        config.data.batch_size, tc.eval_batches * config.data.batch_size);
      metrics.record_eval(step, r.loss, r.perplexity);
    }
    const bool periodic = config.checkpoint.save_every > 0 && step % config.checkpoint.save_every == 0;
    if (periodic || (config.checkpoint.save_final && step == tc.steps)) {
      save_hf_dir(*model, config.checkpoint.dir, parse_dtype(config.model.dtype));
      log_info("saved model at step ", step, " to ", config.checkpoint.dir);
    }
  }
  return summary;
}

}  // namespace fsdpp
