// [data] as the training loop sees it: a source of global micro-batches drawn step by step in
// an order the seed fixes (the same on every rank), from which each rank takes its own rows;
// and the count of targets a step holds over every rank, which the loss divides by so that N
// ranks and accumulation equal one process. Token windows (data/data.h), rows of documents
// (data/packed_documents.h) and multimodal samples (data/multimodal_data.h) are its
// implementations.
#pragma once

#include "data/data_config.h"
#include "data/evaluate.h"
#include "data/micro_batch.h"
#include "distributed/comm.h"
#include "models/causal_lm.h"

#include <nlohmann/json_fwd.hpp>

#include <memory>

namespace fsdpp {

class ShuffledOrder;

class Batches {
 public:
  virtual ~Batches() = default;

  // Draws the next optimizer step's `micro_batches` global micro-batches and returns the
  // targets they hold over every rank (at least 1).
  virtual int64_t draw_step(int64_t micro_batches) = 0;
  // Rows [first, first + count) of micro-batch `micro` of the step drawn last, on the CPU.
  virtual MicroBatch rows(int64_t micro, int64_t first, int64_t count) const = 0;
  // The order a checkpoint saves and restores, and what identifies the stream it indexes:
  // a resume refuses a stream whose identity differs.
  virtual ShuffledOrder& order() = 0;
  virtual nlohmann::json identity() const = 0;
  // What one index of the order draws, for the log: "windows", "rows" or "samples".
  virtual const char* item_name() const = 0;
  // Whether [data] eval_fraction holds a part out for evaluation during training.
  virtual bool can_evaluate() const = 0;
  // The mean loss of at most `max_rows` held-out rows (all where max_rows is 0), or of every
  // row where nothing is held out (a collective with `group`).
  virtual EvalResult evaluate(CausalLM& model, int64_t max_rows, Comm* group) const = 0;
};

// What the batches serve: training draws its steps from them, so a token stream must fill
// one training window of seq_len + 1 tokens; `fsdpp eval` only scores them, in windows of
// seq_len tokens (data/evaluate.h).
enum class BatchUse { train, evaluate };

// The batches `config` names for `model`: a directory is a multimodal dataset, a token file
// with document ends its documents' rows, any other token file its windows. UserError when the
// data does not fit the model (a vocabulary past the model's, images for a model without a
// vision tower).
std::unique_ptr<Batches> open_batches(const DataConfig& config, const ModelConfig& model,
                                      BatchUse use = BatchUse::train);

}  // namespace fsdpp
