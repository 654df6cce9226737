// Token files and batch sampling.
#include "data/data.h"

#include "core/error.h"
#include "core/log.h"
#include "loss/next_token_loss.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
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
  const std::byte* p = file_->data() + header_.tokens_offset + begin * header_.width;
  auto dtype = header_.width == 2 ? at::kUInt16 : at::kUInt32;
  auto view = at::from_blob(const_cast<std::byte*>(p), {length}, at::TensorOptions().dtype(dtype));
  return view.to(at::kLong);
}

at::Tensor TokenFile::mask_slice(int64_t begin, int64_t length) const {
  TORCH_CHECK(has_mask() && begin >= 0 && begin + length <= header_.count, "mask slice out of range");
  auto* p = const_cast<std::byte*>(file_->data() + header_.mask_offset + begin);
  return at::from_blob(p, {length}, at::TensorOptions().dtype(at::kByte)).to(at::kBool);
}

int64_t TokenFile::document_end(int64_t d) const {
  TORCH_CHECK(d >= 0 && d < header_.documents, "document ", d, " out of range");
  uint64_t end = 0;  // unaligned after 2-byte tokens
  std::memcpy(&end, file_->data() + header_.ends_offset + d * 8, 8);
  return static_cast<int64_t>(end);
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

TokenRange train_range(const DataConfig& data, const TokenFile& tokens) {
  const auto held_out = static_cast<int64_t>(static_cast<double>(tokens.size()) * data.eval_fraction);
  return {0, tokens.size() - held_out};
}

TokenRange eval_range(const DataConfig& data, const TokenFile& tokens) {
  if (data.eval_fraction <= 0) return {0, tokens.size()};
  return {train_range(data, tokens).end, tokens.size()};
}

namespace {

// The training windows of seq_len + 1 tokens (inputs, and targets one token on) in the
// training part, or UserError: naming [data] eval_fraction where it is what left too few.
int64_t window_count(const TokenFile& tokens, TokenRange range, const DataConfig& data, int64_t seq_len) {
  const int64_t windows = (range.end - range.begin - 1) / seq_len;
  if (windows >= 1) return windows;
  const std::string window = "one training window of seq_len " + std::to_string(seq_len) + " + 1";
  if (data.eval_fraction > 0 && tokens.size() > seq_len) {
    throw UserError(concat(tokens.path().string(), ": [data] eval_fraction ", data.eval_fraction, " of ", tokens.size(),
                           " tokens leaves ", range.end - range.begin, " to train, fewer than ", window,
                           "; hold out less"));
  }
  throw UserError(tokens.path().string() + ": " + std::to_string(range.end - range.begin) + " tokens cannot fill " +
                  window);
}

}  // namespace

TokenWindows::TokenWindows(std::shared_ptr<const TokenFile> tokens, const DataConfig& config, bool trains)
    : tokens_(std::move(tokens)), config_(config), range_(train_range(config, *tokens_)),
      order_(trains ? window_count(*tokens_, range_, config, config.seq_len) : 0, config.seed, config.shuffle) {
  if (config.train_on == TrainOn::completion && !tokens_->has_mask()) {
    throw UserError(tokens_->path().string() + ": [data] train_on = \"completion\" needs a token file with a loss "
                    "mask (version 2, written by scripts/prepare_data.py)");
  }
  // Found now rather than at the first evaluation, hours into the run.
  if (const TokenRange held_out = eval_range(config, *tokens_);
      config.eval_fraction > 0 && held_out.end - held_out.begin < config.seq_len) {
    throw UserError(concat(tokens_->path().string(), ": [data] eval_fraction ", config.eval_fraction, " holds out ",
                           held_out.end - held_out.begin, " of ", tokens_->size(),
                           " tokens, fewer than one evaluation window of seq_len ", config.seq_len));
  }
}

int64_t TokenWindows::window_start(int64_t micro, int64_t row) const {
  return range_.begin + drawn_[static_cast<size_t>(micro * config_.batch_size + row)] * config_.seq_len;
}

int64_t TokenWindows::draw_step(int64_t micro_batches) {
  drawn_.clear();
  for (int64_t i = 0; i < micro_batches * config_.batch_size; ++i) drawn_.push_back(order_.next());
  if (config_.train_on == TrainOn::all) return micro_batches * config_.batch_size * config_.seq_len;
  // Every rank counts the whole step's marked targets: the same windows, so the same count.
  int64_t targets = 0;
  for (int64_t micro = 0; micro < micro_batches; ++micro) {
    for (int64_t row = 0; row < config_.batch_size; ++row) {
      targets += tokens_->mask_slice(window_start(micro, row) + 1, config_.seq_len).sum().item<int64_t>();
    }
  }
  return std::max<int64_t>(targets, 1);
}

MicroBatch TokenWindows::rows(int64_t micro, int64_t first, int64_t count) const {
  const int64_t seq_len = config_.seq_len;
  std::vector<at::Tensor> windows, masks;
  for (int64_t r = first; r < first + count; ++r) {
    windows.push_back(tokens_->slice(window_start(micro, r), seq_len + 1));
    if (config_.train_on == TrainOn::completion) masks.push_back(tokens_->mask_slice(window_start(micro, r) + 1, seq_len));
  }
  auto stacked = at::stack(windows);  // [rows, T + 1]
  // Out of place: a one-row batch's target is a view that shares its storage with the input.
  at::Tensor target = stacked.narrow(1, 1, seq_len).contiguous();  // [rows, T]
  if (!masks.empty()) target = target.masked_fill(at::stack(masks).logical_not(), kIgnoredTarget);
  return {stacked.narrow(1, 0, seq_len).contiguous(), target, {}};
}

nlohmann::json TokenWindows::identity() const {
  return {{"train", std::filesystem::absolute(config_.train).lexically_normal().string()},
          {"contents", tokens_->fingerprint()}, {"tokens", tokens_->size()}, {"begin", range_.begin},
          {"end", range_.end}, {"shuffle", config_.shuffle}, {"seq_len", config_.seq_len}, {"seed", config_.seed},
          {"batch_size", config_.batch_size}};
}

EvalResult TokenWindows::evaluate(CausalLM& model, int64_t max_windows, Comm* group) const {
  const TokenRange held_out = eval_range(config_, *tokens_);
  return fsdpp::evaluate(model, *tokens_, held_out.begin, held_out.end, config_.seq_len, config_.batch_size,
                         max_windows, group, config_.train_on == TrainOn::completion);
}

}  // namespace fsdpp
