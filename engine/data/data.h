// Training data: memory-mapped token files (data/token_header.h) split into a training
// part and a held-out tail, and deterministic shuffled batches of windows.
#pragma once

#include "core/mapped_file.h"
#include "data/batches.h"
#include "data/data_config.h"
#include "data/token_header.h"

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <random>

namespace fsdpp {

class TokenFile {
 public:
  // Validates the header and every token (TokenHeader::parse); UserError naming the file.
  static TokenFile open(const std::filesystem::path& path);

  int64_t size() const { return header_.count; }
  int64_t vocab_size() const { return header_.vocab; }
  const std::filesystem::path& path() const { return file_->path(); }
  // The file's fingerprint as mapped (core/mapped_file.h): a checkpoint's data position
  // carries over only to the same contents.
  std::string fingerprint() const { return file_fingerprint(*file_); }
  // Tokens [begin, begin + length) as int64.
  at::Tensor slice(int64_t begin, int64_t length) const;  // [length]
  // Whether the file carries a loss mask, and its flags [begin, begin + length): true where
  // the token is a training target.
  bool has_mask() const { return header_.has_mask; }
  at::Tensor mask_slice(int64_t begin, int64_t length) const;  // [length] bool
  // Version 2: the documents the tokens hold (0: one unbroken stream), and where document `d`
  // ends (a token offset; the last document ends at size()).
  int64_t documents() const { return header_.documents; }
  int64_t document_end(int64_t d) const;

 private:
  std::shared_ptr<MappedFile> file_;
  TokenHeader header_;
};

// Visits the indices 0..size-1 once per epoch, in an order fixed by (seed, epoch), or in
// order when shuffling is off.
class ShuffledOrder {
 public:
  ShuffledOrder(int64_t size, uint64_t seed, bool shuffle);

  int64_t next();
  int64_t size() const { return static_cast<int64_t>(order_.size()); }

  // Where the next index comes from: with the same size, seed and shuffle, seeking to a
  // saved position continues the exact sequence.
  struct Position {
    uint64_t epoch = 0;
    int64_t window = 0;  // index into the epoch's order
  };
  Position position() const { return {epoch_, static_cast<int64_t>(cursor_)}; }
  void seek(Position position);

 private:
  void reorder();

  uint64_t seed_, epoch_ = 0;
  bool shuffle_;
  size_t cursor_ = 0;
  std::vector<int64_t> order_;
};

// Which tokens of a file a run trains on and which it holds out: the held-out part is the
// file's last eval_fraction (all of it is evaluated when nothing is held out).
struct TokenRange {
  int64_t begin = 0, end = 0;
};
TokenRange train_range(const DataConfig& data, const TokenFile& tokens);
TokenRange eval_range(const DataConfig& data, const TokenFile& tokens);

// The training windows of a token file: non-overlapping windows of seq_len + 1 tokens of its
// training part, each input predicting its next token; every epoch visits each window once.
// Every token is a target, so a step holds micro-batches x batch_size x seq_len of them, unless
// train_on = "completion", where only the tokens the file's loss mask marks are.
class TokenWindows : public Batches {
 public:
  // `trains`: steps are drawn, so the training part must fill a window; without, the
  // windows are only evaluated (fsdpp eval), and a stream of seq_len tokens is enough.
  TokenWindows(std::shared_ptr<const TokenFile> tokens, const DataConfig& config, bool trains = true);

  int64_t draw_step(int64_t micro_batches) override;
  MicroBatch rows(int64_t micro, int64_t first, int64_t count) const override;
  ShuffledOrder& order() override { return order_; }
  nlohmann::json identity() const override;
  const char* item_name() const override { return "windows"; }
  bool can_evaluate() const override { return config_.eval_fraction > 0; }
  EvalResult evaluate(CausalLM& model, int64_t max_windows, Comm* group) const override;

 private:
  // Where row `row` of micro-batch `micro` of the drawn step starts in the file.
  int64_t window_start(int64_t micro, int64_t row) const;

  std::shared_ptr<const TokenFile> tokens_;
  DataConfig config_;
  TokenRange range_;
  ShuffledOrder order_;
  std::vector<int64_t> drawn_;  // the step's windows, micro-batch after micro-batch
};

}  // namespace fsdpp
