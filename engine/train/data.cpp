// Token files and batch sampling.
#include "train/data.h"

#include "core/error.h"
#include "core/config_file.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

namespace fsdpp {

namespace {
constexpr char kMagic[8] = {'F', 'S', 'D', 'P', 'T', 'O', 'K', '\0'};
constexpr size_t kHeaderBytes = 32;
}  // namespace

DataConfig DataConfig::from_section(ConfigSection& s) {
  DataConfig c;
  c.train = s.get_string("train", "");
  c.seq_len = s.get_int("seq_len", c.seq_len, 1, kMaxBatchTokens);
  c.batch_size = s.get_int("batch_size", c.batch_size, 1, kMaxBatchTokens);
  c.eval_fraction = s.get_double("eval_fraction", c.eval_fraction, 0, 1);
  c.seed = static_cast<uint64_t>(s.get_int("seed", 0, 0, kMaxSeed));
  c.shuffle = s.get_bool("shuffle", c.shuffle);
  s.finish();
  if (c.train.empty()) s.fail("train", "required: the token file to train on");
  if (c.batch_size > kMaxBatchTokens / c.seq_len) {
    s.fail("batch_size", "a global batch of " + std::to_string(c.batch_size) + " x " + std::to_string(c.seq_len) +
                             " tokens is more than " + std::to_string(kMaxBatchTokens) + " (batch_size x seq_len)");
  }
  if (c.eval_fraction >= 1) {
    s.fail("eval_fraction", "must be in [0, 1), got " + std::to_string(c.eval_fraction));
  }
  return c;
}

TokenFile TokenFile::open(const std::filesystem::path& path) {
  TokenFile t;
  t.file_ = MappedFile::open(path);
  const std::string where = path.string();
  if (t.file_->size() < kHeaderBytes || std::memcmp(t.file_->data(), kMagic, 8) != 0) {
    throw UserError(where + ": not an fsdpp token file (bad magic; make one with scripts/make_tokens.py)");
  }
  uint32_t version = 0, width = 0;
  uint64_t count = 0, vocab = 0;
  std::memcpy(&version, t.file_->data() + 8, 4);
  std::memcpy(&width, t.file_->data() + 12, 4);
  std::memcpy(&count, t.file_->data() + 16, 8);
  std::memcpy(&vocab, t.file_->data() + 24, 8);
  if (version != 1) throw UserError(where + ": token file version " + std::to_string(version) + " is not supported");
  if (width != 2 && width != 4) throw UserError(where + ": bytes per token " + std::to_string(width) + " (expected 2 or 4)");
  // Compared in tokens, so a count near 2^64 cannot overflow into a match.
  const uint64_t held = (t.file_->size() - kHeaderBytes) / width;
  if (count != held || (t.file_->size() - kHeaderBytes) % width != 0) {
    throw UserError(where + ": truncated or padded token file: header says " + std::to_string(count) +
                    " tokens, file has " + std::to_string(t.file_->size()) + " bytes (" + std::to_string(held) +
                    " tokens of " + std::to_string(width) + " bytes after the header)");
  }
  if (vocab < 1 || vocab > (uint64_t{1} << 32)) {
    throw UserError(where + ": header vocabulary " + std::to_string(vocab) + " is not in [1, 2^32]");
  }
  t.count_ = static_cast<int64_t>(count);
  t.vocab_ = static_cast<int64_t>(vocab);
  t.width_ = width;
  // Once, where the file enters, rather than per window on the training path: a token past
  // the vocabulary would index past the embedding table.
  t.check_vocabulary();
  return t;
}

at::Tensor TokenFile::slice(int64_t begin, int64_t length) const {
  TORCH_CHECK(begin >= 0 && begin + length <= count_, "token slice out of range");
  const std::byte* p = file_->data() + kHeaderBytes + begin * width_;
  auto dtype = width_ == 2 ? at::kUInt16 : at::kUInt32;
  auto view = at::from_blob(const_cast<std::byte*>(p), {length}, at::TensorOptions().dtype(dtype));
  return view.to(at::kLong);
}

void TokenFile::check_vocabulary() const {
  // A width that cannot hold a value at or past the vocabulary needs no scan.
  if (static_cast<uint64_t>(vocab_) >= (uint64_t{1} << (8 * width_))) return;
  constexpr int64_t kChunk = int64_t{1} << 22;  // tokens per pass: 32 MiB as int64
  for (int64_t begin = 0; begin < count_; begin += kChunk) {
    const at::Tensor tokens = slice(begin, std::min(kChunk, count_ - begin));
    if (tokens.max().item<int64_t>() < vocab_) continue;
    const int64_t first = at::nonzero(tokens >= vocab_)[0][0].item<int64_t>();
    throw UserError(file_->path().string() + ": the token at position " + std::to_string(begin + first) + " is " +
                    std::to_string(tokens[first].item<int64_t>()) + ", outside the header's vocabulary of " +
                    std::to_string(vocab_));
  }
}

ShuffledOrder::ShuffledOrder(int64_t size, uint64_t seed, bool shuffle)
    : seed_(seed), shuffle_(shuffle), order_(static_cast<size_t>(size)) {
  reorder();
}

void ShuffledOrder::reorder() {
  std::iota(order_.begin(), order_.end(), 0);
  if (!shuffle_) return;
  std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ull + epoch_);
  std::shuffle(order_.begin(), order_.end(), rng);
}

int64_t ShuffledOrder::next() {
  if (cursor_ == order_.size()) {
    ++epoch_;
    cursor_ = 0;
    reorder();
  }
  return order_[cursor_++];
}

void ShuffledOrder::seek(Position position) {
  TORCH_CHECK(position.window >= 0 && position.window <= size(), "window ", position.window,
              " is outside an epoch of ", size());
  epoch_ = position.epoch;
  cursor_ = static_cast<size_t>(position.window);
  reorder();
}

namespace {

int64_t window_count(const TokenFile& tokens, int64_t begin, int64_t end, int64_t seq_len) {
  const int64_t windows = (end - begin - 1) / seq_len;
  if (windows < 1) {
    throw UserError(tokens.path().string() + ": " + std::to_string(end - begin) +
                    " tokens cannot fill one window of seq_len " + std::to_string(seq_len) + " + 1");
  }
  return windows;
}

}  // namespace

BatchSampler::BatchSampler(const TokenFile& tokens, int64_t begin, int64_t end, int64_t seq_len,
                           int64_t batch_size, uint64_t seed, bool shuffle)
    : tokens_(&tokens), begin_(begin), seq_len_(seq_len), batch_size_(batch_size),
      order_(window_count(tokens, begin, end, seq_len), seed, shuffle) {}

BatchSampler::Batch BatchSampler::next() {
  std::vector<at::Tensor> windows;
  for (int64_t i = 0; i < batch_size_; ++i) {
    windows.push_back(tokens_->slice(begin_ + order_.next() * seq_len_, seq_len_ + 1));
  }
  auto stacked = at::stack(windows);  // [B, T + 1]
  return {stacked.narrow(1, 0, seq_len_).contiguous(), stacked.narrow(1, 1, seq_len_).contiguous()};
}

}  // namespace fsdpp
