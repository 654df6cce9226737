// Evaluation over rows: the mean next-token loss, shared out over the ranks of a group.
#include "data/evaluate.h"

#include "core/device.h"
#include "core/error.h"
#include "data/data.h"
#include "loss/next_token_loss.h"

#include <ATen/ATen.h>

#include <cmath>

namespace fsdpp {

EvalResult evaluate_rows(CausalLM& model, int64_t rows, int64_t batch_size, const EvalRows& batch, Comm* group,
                         const std::string& where) {
  at::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  // Batch k goes to rank k mod W. Every rank runs the same number of forwards, since a
  // sharded model gathers its units in each one: a rank out of batches in the last round
  // runs its first row again and does not count it.
  const int rank = group ? group->rank() : 0, world = group ? group->size() : 1;
  const int64_t batches = (rows + batch_size - 1) / batch_size;
  const auto device = model.parameters().front().device();
  at::Tensor sums = at::zeros({2}, at::TensorOptions(at::kDouble).device(device));  // loss, targets
  for (int64_t round = 0; round * world < batches; ++round) {
    const int64_t index = round * world + rank;
    const bool counted = index < batches;
    const int64_t first = counted ? index * batch_size : 0;
    MicroBatch b = batch(first, counted ? std::min(batch_size, rows - first) : 1);
    b.input = to_device(b.input, device);
    auto logits = b.logits(model);  // [b, T, V]
    if (!counted) continue;
    auto targets = to_device(b.target, device);  // [b, T]
    sums[0] += next_token_loss_sum(logits, targets).to(at::kDouble).squeeze();
    sums[1] += (targets != kIgnoredTarget).sum().to(at::kDouble);
  }
  if (group) group->all_reduce_sum(sums);
  model.train(was_training);
  EvalResult r;
  r.windows = rows;
  r.tokens = static_cast<int64_t>(sums[1].item<double>());
  if (r.tokens == 0) throw UserError(where + ": the evaluated rows hold no target to predict");
  r.loss = sums[0].item<double>() / static_cast<double>(r.tokens);
  r.perplexity = std::exp(r.loss);
  return r;
}

EvalResult evaluate(CausalLM& model, const TokenFile& tokens, int64_t begin, int64_t end,
                    int64_t seq_len, int64_t batch_size, int64_t max_windows, Comm* group, bool masked_targets) {
  if (seq_len < 2) throw UserError("evaluation needs seq_len >= 2, got " + std::to_string(seq_len));
  int64_t windows = (end - begin) / seq_len;
  if (max_windows > 0) windows = std::min(windows, max_windows);
  if (windows < 1) {
    throw UserError(tokens.path().string() + ": " + std::to_string(end - begin) +
                    " tokens cannot fill one evaluation window of " + std::to_string(seq_len));
  }
  auto window_rows = [&](int64_t first, int64_t count) {
    auto ids = tokens.slice(begin + first * seq_len, count * seq_len).view({count, seq_len});  // [b, T]
    // Each window predicts its own next tokens; its last token predicts nothing.
    auto targets = at::full_like(ids, kIgnoredTarget);
    targets.narrow(1, 0, seq_len - 1).copy_(ids.narrow(1, 1, seq_len - 1));
    if (masked_targets) {
      const at::Tensor marked = tokens.mask_slice(begin + first * seq_len, count * seq_len).view({count, seq_len});
      targets.narrow(1, 0, seq_len - 1).masked_fill_(marked.narrow(1, 1, seq_len - 1).logical_not(), kIgnoredTarget);
    }
    return MicroBatch{ids, targets, {}, {}};
  };
  return evaluate_rows(model, windows, batch_size, window_rows, group, tokens.path().string());
}

}  // namespace fsdpp
