// Multimodal training data for vision-language models. A dataset is a directory holding
//   samples.jsonl       one sample per line: {"input_ids": [...], "images": [{"pixels": KEY,
//                       "grid": [t, h, w]}, ...], "videos": [{"pixels": KEY, "grid": [t, h, w],
//                       "seconds_per_grid": s}, ...], "prompt_length": n}; images, videos and
//                       prompt_length may be absent (text; no prompt)
//   pixels.safetensors  each KEY's patches [t * h * w, C * Tt * P * P], as the HF processor
//                       cuts them (scripts/make_multimodal.py writes both files)
// input_ids holds one placeholder token per merged patch group of each image and video, in
// order. Targets never ask for a placeholder, nor for the padding after a short sample, and
// under [data] train_on = "completion" not for the sample's first prompt_length tokens.
#pragma once

#include "data/batches.h"
#include "data/data.h"
#include "data/sample_index.h"

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace fsdpp {

class SafetensorsFile;

class MultimodalDataset {
 public:
  // Reads and validates the whole index: every error names samples.jsonl and the line (a
  // sample longer than seq_len + 1, a placeholder count that its grids do not give, a
  // missing pixel key, a token outside the vocabulary); train_on = "completion" over samples
  // none of which marks a prompt is refused.
  static MultimodalDataset open(const std::filesystem::path& dir, const ModelConfig& model, int64_t seq_len,
                                TrainOn train_on);

  int64_t size() const { return static_cast<int64_t>(samples_.size()); }
  const std::filesystem::path& dir() const { return dir_; }
  // What tells either file rewritten since: samples.jsonl's CRC-32C, pixels.safetensors'
  // fingerprint (core/mapped_file.h).
  nlohmann::json contents() const;
  // Tokens the samples ask to be predicted (their targets that are not kIgnoredTarget).
  int64_t target_count(const std::vector<int64_t>& samples) const;
  MicroBatch batch(const std::vector<int64_t>& samples) const;

 private:
  at::Tensor targets(const SampleRecord& sample) const;  // [T]

  std::filesystem::path dir_;
  std::string samples_checksum_;  // samples.jsonl's, as read
  int64_t seq_len_ = 0, image_token_ = -1, video_token_ = -1;
  TrainOn train_on_ = TrainOn::all;
  std::vector<SampleRecord> samples_;
  std::shared_ptr<SafetensorsFile> pixels_;
};

// A dataset's samples as a run's batches: every epoch visits each training sample once, in
// an order the seed fixes; a step's targets are those its samples ask for, which vary with
// their lengths and placeholders. [data] eval_fraction holds out the file's last samples
// (rounded down) for evaluation.
class MultimodalSamples : public Batches {
 public:
  // UserError where eval_fraction holds out no sample, or all of them.
  MultimodalSamples(MultimodalDataset dataset, const DataConfig& config);

  int64_t draw_step(int64_t micro_batches) override;
  MicroBatch rows(int64_t micro, int64_t first, int64_t count) const override;
  ShuffledOrder& order() override { return order_; }
  nlohmann::json identity() const override;
  const char* item_name() const override { return "samples"; }
  bool can_evaluate() const override { return config_.eval_fraction > 0; }
  EvalResult evaluate(CausalLM& model, int64_t max_rows, Comm* group) const override;

 private:
  MultimodalDataset dataset_;
  DataConfig config_;
  int64_t train_samples_;  // samples [0, train_samples_) train; the rest are held out
  ShuffledOrder order_;
  std::vector<int64_t> drawn_;  // the step's samples, micro-batch after micro-batch
};

}  // namespace fsdpp
