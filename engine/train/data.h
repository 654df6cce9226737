// Training data: memory-mapped token files (train/token_header.h) split into a training
// part and a held-out tail, and deterministic shuffled batches of windows.
#pragma once

#include "core/mapped_file.h"
#include "train/data_config.h"
#include "train/token_header.h"

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
  // Tokens [begin, begin + length) as int64.
  at::Tensor slice(int64_t begin, int64_t length) const;  // [length]

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

// Draws batches of (input, target) windows from tokens [begin, end): each epoch visits every
// non-overlapping window once.
class BatchSampler {
 public:
  BatchSampler(const TokenFile& tokens, int64_t begin, int64_t end, int64_t seq_len,
               int64_t batch_size, uint64_t seed, bool shuffle = true);

  struct Batch {
    at::Tensor input;   // [B, T] int64
    at::Tensor target;  // [B, T] int64, input shifted by one
  };
  Batch next();
  int64_t windows_per_epoch() const { return order_.size(); }
  ShuffledOrder& order() { return order_; }

 private:
  const TokenFile* tokens_;
  int64_t begin_, seq_len_, batch_size_;
  ShuffledOrder order_;
};

}  // namespace fsdpp
