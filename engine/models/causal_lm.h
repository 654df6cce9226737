// The interface every language model offers the trainer: token ids in, logits out, plus
// what wrap policies read (config, no_split_modules).
#pragma once

#include "core/device.h"
#include "core/error.h"
#include "core/module.h"
#include "models/kv_cache.h"
#include "models/model_config.h"

#include <string>
#include <vector>

namespace fsdpp {

struct RoutingLog;

// The images and videos of a batch, cut into patches as the HF processor cuts them.
struct VisionInputs {
  torch::Tensor pixel_values;         // [Ni, C * Tt * P * P] image patches; undefined: none
  torch::Tensor image_grid_thw;       // [I, 3] int64: frames, rows, columns of patches per image
  torch::Tensor pixel_values_videos;  // [Nv, C * Tt * P * P] video patches; undefined: none
  torch::Tensor video_grid_thw;       // [V, 3] int64
  torch::Tensor second_per_grid_ts;   // [V] seconds per temporal patch (Qwen2.5-VL); undefined: 1

  bool empty() const { return !pixel_values.defined() && !pixel_values_videos.defined(); }
  // The patches on `device`; grids and timings stay on the host, where positions are planned.
  VisionInputs to(const torch::Device& device) const {
    VisionInputs moved = *this;
    moved.pixel_values = to_device(pixel_values, device);
    moved.pixel_values_videos = to_device(pixel_values_videos, device);
    return moved;
  }
};

// How tokens sit in a batch's rows: where the documents packed into them begin
// (models/document_attention.h: attention stays inside each document, and positions restart
// at each), and the RoPE positions, where the caller chose them.
struct RowLayout {
  torch::Tensor offsets;    // [S + 1] int64 offsets into the rows read one after another; undefined:
                            // one sequence per row
  torch::Tensor positions;  // [B, T] int64; undefined: each token's distance from its document's start

  bool empty() const { return !offsets.defined() && !positions.defined(); }
};

// Asks forward for the final hidden states [B, T, C] in place of logits, for a caller that
// applies the output head itself (chunked log-probabilities, which never hold [B, T, V]).
struct FinalHidden {
  RowLayout layout;     // as forward(input_ids, layout) takes it
  VisionInputs vision;  // the rows' images and videos (vision-language models alone take any)
};

// One step of a generation (Run::generate): tokens after what `cache` holds.
struct GenerationStep {
  KvCache* cache;
  torch::Tensor kept;   // [B, T] bool: false for padding (a left-padded prompt's)
  VisionInputs vision;  // the prompt's images and videos (its first step's; a vision-language model's)
};

class CausalLM : public Module {
 public:
  CausalLM(std::string class_name, ModelConfig config, std::vector<std::string> no_split)
      : Module(std::move(class_name)), config_(std::move(config)), no_split_(std::move(no_split)) {}

  FSDPP_MODULE_CALL
  // [B, T] -> [B, T, V]; a sequence-classification model's scores [B, T, labels] (ModelConfig::num_labels)
  virtual torch::Tensor forward(const torch::Tensor& input_ids) = 0;
  // With the batch's images and videos, in rows laid out as `layout` says; only
  // vision-language models take them.
  virtual torch::Tensor forward(const torch::Tensor& input_ids, const VisionInputs& vision, const RowLayout& layout) {
    throw UserError(class_name() + " takes no images or videos");
  }
  // With several documents packed into each row, or positions of the caller's choosing.
  virtual torch::Tensor forward(const torch::Tensor& input_ids, const RowLayout& layout) = 0;
  // The final hidden states [B, T, C], for a caller that applies the output head itself.
  virtual torch::Tensor forward(const torch::Tensor& input_ids, const FinalHidden& ask) = 0;
  // The output head's weight [V, C] (a score head's [labels, C]) as it is now (gathered while
  // its unit computes), and whether the head carries a LoRA adapter, which the weight alone
  // leaves out.
  virtual torch::Tensor output_head_weight() const = 0;
  virtual bool output_head_adapted() const = 0;

  // The logits [B, V] of each row's last token of a generation's step.
  virtual torch::Tensor forward(const torch::Tensor& input_ids, const GenerationStep& step) = 0;
  // The cache a generation of at most `capacity` tokens a row keeps.
  virtual KvCache generation_cache(int64_t capacity) const = 0;

  // Mixture-of-experts models: what their MoE layers routed in the last forward.
  virtual RoutingLog* routing() const { return nullptr; }

  const ModelConfig& config() const { return config_; }
  // Classes that must stay whole inside one unit (Hugging Face's _no_split_modules).
  const std::vector<std::string>& no_split_modules() const { return no_split_; }

 private:
  ModelConfig config_;
  std::vector<std::string> no_split_;
};

}  // namespace fsdpp
