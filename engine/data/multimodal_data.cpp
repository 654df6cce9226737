// Reading multimodal samples and assembling a batch's rows and vision inputs.
#include "data/multimodal_data.h"

#include "core/checksum.h"
#include "core/error.h"
#include "core/log.h"
#include "core/mapped_file.h"
#include "data/evaluate.h"
#include "io/safetensors.h"
#include "loss/next_token_loss.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>

namespace fsdpp {

namespace fs = std::filesystem;

MultimodalDataset MultimodalDataset::open(const fs::path& dir, const ModelConfig& model, int64_t seq_len,
                                          TrainOn train_on) {
  if (!model.vision) {
    throw UserError(dir.string() + ": a multimodal dataset needs a vision-language model, not model_type '" +
                    model.model_type + "'");
  }
  MultimodalDataset d;
  d.dir_ = dir;
  d.seq_len_ = seq_len;
  d.train_on_ = train_on;
  d.image_token_ = model.image_token_id;
  d.video_token_ = model.video_token_id;
  d.pixels_ = SafetensorsFile::open(dir / "pixels.safetensors");
  const fs::path index = dir / "samples.jsonl";
  const std::string text = read_text_file(index);
  d.samples_checksum_ = format_crc32c(crc32c(text.data(), text.size()));
  d.samples_ = parse_samples(text, index.string(), model, seq_len, d.pixels_->entries());
  const bool prompts = std::any_of(d.samples_.begin(), d.samples_.end(),
                                   [](const SampleRecord& sample) { return sample.prompt_length > 0; });
  if (train_on == TrainOn::completion && !prompts) {
    throw UserError(index.string() + ": [data] train_on = \"completion\" learns what follows each sample's prompt, "
                    "and no sample marks one (\"prompt_length\"; scripts/make_multimodal.py writes it for manifest "
                    "lines of \"prompt\" and \"completion\")");
  }
  return d;
}

nlohmann::json MultimodalDataset::contents() const {
  return {{"samples.jsonl", samples_checksum_}, {"pixels.safetensors", pixels_->fingerprint()}};
}

at::Tensor MultimodalDataset::targets(const SampleRecord& sample) const {
  auto target = at::full({seq_len_}, kIgnoredTarget, at::kLong);
  const size_t first = train_on_ == TrainOn::completion ? std::max<int64_t>(1, sample.prompt_length) : 1;
  for (size_t i = first; i < sample.input_ids.size(); ++i) {
    const int64_t next = sample.input_ids[i];
    if (next != image_token_ && next != video_token_) target[static_cast<int64_t>(i) - 1] = next;
  }
  return target;
}

int64_t MultimodalDataset::target_count(const std::vector<int64_t>& samples) const {
  int64_t n = 0;
  for (int64_t s : samples) {
    const SampleRecord& sample = samples_[static_cast<size_t>(s)];
    n += train_on_ == TrainOn::completion ? sample.completion_target_count : sample.target_count;
  }
  return n;
}

MicroBatch MultimodalDataset::batch(const std::vector<int64_t>& samples) const {
  std::vector<at::Tensor> inputs, targets_, image_pixels, image_grids, video_pixels, video_grids, seconds;
  for (int64_t s : samples) {
    const SampleRecord& sample = samples_[static_cast<size_t>(s)];
    auto input = at::zeros({seq_len_}, at::kLong);  // short samples are padded with token 0, never predicted
    const auto n = std::min<int64_t>(seq_len_, static_cast<int64_t>(sample.input_ids.size()));
    input.narrow(0, 0, n).copy_(at::tensor(std::vector<int64_t>(sample.input_ids.begin(), sample.input_ids.begin() + n)));
    inputs.push_back(input);
    targets_.push_back(targets(sample));
    for (const auto& v : sample.images) {
      image_pixels.push_back(pixels_->tensor(v.pixels).to(at::kFloat));
      image_grids.push_back(at::tensor(v.grid, at::kLong));
    }
    for (const auto& v : sample.videos) {
      video_pixels.push_back(pixels_->tensor(v.pixels).to(at::kFloat));
      video_grids.push_back(at::tensor(v.grid, at::kLong));
      seconds.push_back(at::full({1}, v.seconds, at::kDouble));
    }
  }
  MicroBatch b{at::stack(inputs), at::stack(targets_), {}};
  if (!image_pixels.empty()) b.vision.pixel_values = at::cat(image_pixels), b.vision.image_grid_thw = at::stack(image_grids);
  if (!video_pixels.empty()) {
    b.vision.pixel_values_videos = at::cat(video_pixels);
    b.vision.video_grid_thw = at::stack(video_grids);
    b.vision.second_per_grid_ts = at::cat(seconds);
  }
  return b;
}

namespace {

// The samples that train: all but the last eval_fraction of them.
int64_t training_samples(const MultimodalDataset& dataset, const DataConfig& config) {
  const int64_t held_out = static_cast<int64_t>(static_cast<double>(dataset.size()) * config.eval_fraction);
  if (config.eval_fraction > 0 && (held_out < 1 || held_out >= dataset.size())) {
    throw UserError(concat((dataset.dir() / "samples.jsonl").string(), ": [data] eval_fraction ", config.eval_fraction,
                           " holds out ", held_out, " of its ", dataset.size(),
                           " samples; it must hold out at least one and leave one to train"));
  }
  return dataset.size() - held_out;
}

}  // namespace

MultimodalSamples::MultimodalSamples(MultimodalDataset dataset, const DataConfig& config)
    : dataset_(std::move(dataset)),
      config_(config),
      train_samples_(training_samples(dataset_, config)),
      order_(train_samples_, config.seed, config.shuffle) {}

int64_t MultimodalSamples::draw_step(int64_t micro_batches) {
  drawn_.clear();
  for (int64_t i = 0; i < micro_batches * config_.batch_size; ++i) drawn_.push_back(order_.next());
  return std::max<int64_t>(dataset_.target_count(drawn_), 1);
}

MicroBatch MultimodalSamples::rows(int64_t micro, int64_t first, int64_t count) const {
  const auto begin = drawn_.begin() + micro * config_.batch_size + first;
  return dataset_.batch({begin, begin + count});
}

nlohmann::json MultimodalSamples::identity() const {
  return {{"train", fs::absolute(config_.train).lexically_normal().string()}, {"contents", dataset_.contents()},
          {"tokens", dataset_.size()}, {"begin", 0}, {"end", train_samples_}, {"shuffle", config_.shuffle},
          {"seq_len", config_.seq_len}, {"seed", config_.seed}, {"batch_size", config_.batch_size}};
}

EvalResult MultimodalSamples::evaluate(CausalLM& model, int64_t max_rows, Comm* group) const {
  // With nothing held out (fsdpp eval of a whole dataset), every sample is evaluated.
  const int64_t first_evaluated = train_samples_ < dataset_.size() ? train_samples_ : 0;
  const int64_t evaluated = dataset_.size() - first_evaluated;
  const int64_t rows = max_rows > 0 ? std::min(max_rows, evaluated) : evaluated;
  auto batch = [&](int64_t first, int64_t count) {
    std::vector<int64_t> samples(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) samples[static_cast<size_t>(i)] = first_evaluated + first + i;
    return dataset_.batch(samples);
  };
  return evaluate_rows(model, rows, config_.batch_size, batch, group, (dataset_.dir() / "samples.jsonl").string());
}

}  // namespace fsdpp
