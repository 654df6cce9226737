// Evaluation over held-out rows with the training objective (loss/next_token_loss), the way
// perplexity is usually reported for Hugging Face models.
#pragma once

#include "data/micro_batch.h"
#include "distributed/comm.h"
#include "models/causal_lm.h"

#include <functional>
#include <string>

namespace fsdpp {

class TokenFile;

struct EvalResult {
  int64_t windows = 0;     // rows evaluated: windows, or rows of documents
  int64_t tokens = 0;      // predicted tokens (the targets that are not kIgnoredTarget)
  double loss = 0.0;       // mean next-token loss in nats
  double perplexity = 0.0;
};

// Rows [first, first + count) of what is evaluated, on the CPU.
using EvalRows = std::function<MicroBatch(int64_t first, int64_t count)>;

// Mean loss over `rows` rows taken `batch_size` at a time from `batch`. With `group`, its ranks
// share the batches and every rank returns the same result (a collective). UserError naming
// `where` when the rows hold no target.
EvalResult evaluate_rows(CausalLM& model, int64_t rows, int64_t batch_size, const EvalRows& batch, Comm* group,
                         const std::string& where);

// Mean loss over consecutive non-overlapping windows of `seq_len` tokens of tokens
// [begin, end), each window predicting its own tokens 2..seq_len (as transformers does with
// labels = input_ids). At most `max_windows` windows when positive. With
// `masked_targets`, only the tokens the file's loss mask marks are predicted (the labels of the
// rest are kIgnoredTarget), as [data] train_on = "completion" trains.
EvalResult evaluate(CausalLM& model, const TokenFile& tokens, int64_t begin, int64_t end,
                    int64_t seq_len, int64_t batch_size, int64_t max_windows = 0, Comm* group = nullptr,
                    bool masked_targets = false);

}  // namespace fsdpp
