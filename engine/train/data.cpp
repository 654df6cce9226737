// Token files and batch sampling.
#include "train/data.h"

#include "core/error.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>
#include <random>

namespace fsdpp {

TokenFile TokenFile::open(const std::filesystem::path& path) {
  TokenFile t;
  t.file_ = MappedFile::open(path);
  t.header_ = TokenHeader::parse(t.file_->data(), t.file_->size(), path.string());
  return t;
}

at::Tensor TokenFile::slice(int64_t begin, int64_t length) const {
  TORCH_CHECK(begin >= 0 && begin + length <= header_.count, "token slice out of range");
  const std::byte* p = file_->data() + kTokenHeaderBytes + begin * header_.width;
  auto dtype = header_.width == 2 ? at::kUInt16 : at::kUInt32;
  auto view = at::from_blob(const_cast<std::byte*>(p), {length}, at::TensorOptions().dtype(dtype));
  return view.to(at::kLong);
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
