// Qwen2-VL's and Qwen2.5-VL's forward: one pass of the vision tower over the batch's
// images and videos together, their features scattered into the placeholder embeddings,
// and the decoder run with multimodal RoPE positions.
#include "models/qwen_vl.h"

#include "core/error.h"
#include "models/multimodal_positions.h"

#include <ATen/ATen.h>

namespace fsdpp {

namespace {

int64_t merged_tokens(const torch::Tensor& grid_thw, int64_t merge) {
  return grid_thw.defined() && grid_thw.numel() > 0 ? grid_thw.prod(1).sum().item<int64_t>() / (merge * merge) : 0;
}

// Class names: Qwen2VLDecoderLayer, Qwen2_5_VLDecoderLayer, ...
std::string prefix_of(const ModelConfig& c) {
  TORCH_CHECK(c.vision, c.model_type, " needs a vision_config");
  return c.vision->windowed ? "Qwen2_5_VL" : "Qwen2VL";
}

}  // namespace

VisionLanguageLM::VisionLanguageLM(const ModelConfig& c, const torch::TensorOptions& opts)
    : CausalLM(prefix_of(c) + "ForConditionalGeneration", c,
               {prefix_of(c) + "DecoderLayer", prefix_of(c) + "VisionBlock"}) {
  visual_ = register_child("visual", std::make_shared<VisionTransformer>(*c.vision, opts));
  model_ = register_child("model", std::make_shared<DecoderModel>(DecoderFamily{.prefix = prefix_of(c), .qkv_bias = true}, c,
                                                                  opts, prefix_of(c) + "TextModel"));
  lm_head_ = c.tie_word_embeddings ? std::make_shared<Linear>(model_->embed_tokens->weight)
                                   : std::make_shared<Linear>(c.hidden_size, c.vocab_size, false, opts);
  register_child("lm_head", lm_head_);
}

torch::Tensor VisionLanguageLM::forward(const torch::Tensor& input_ids) {
  return (*lm_head_)(hidden(input_ids, VisionInputs{}, RowLayout{}));
}

torch::Tensor VisionLanguageLM::forward(const torch::Tensor& input_ids, const VisionInputs& vision,
                                        const RowLayout& layout) {
  return (*lm_head_)(hidden(input_ids, vision, layout));
}

torch::Tensor VisionLanguageLM::forward(const torch::Tensor& input_ids, const RowLayout& layout) {
  return (*lm_head_)(hidden(input_ids, VisionInputs{}, layout));
}

torch::Tensor VisionLanguageLM::forward(const torch::Tensor& input_ids, const FinalHidden& ask) {
  return hidden(input_ids, ask.vision, ask.layout);
}

torch::Tensor VisionLanguageLM::forward(const torch::Tensor& input_ids, const GenerationStep& step) {
  KvCache& cache = *step.cache;
  const bool prompt = cache.cached() == 0;
  const at::Tensor kept = step.kept.to(input_ids.device());  // [B, T]
  const CachedStep layout = cache.begin_step(kept);
  torch::Tensor positions;  // [3, B, T]
  if (prompt) {
    positions = position_ids(input_ids, step.vision, layout.documents);
    // The text after the prompt counts on from its largest position: its tokens' count moved
    // by what the images' blocks saved, per row.
    const at::Tensor largest = positions.amax(0).masked_fill(~kept, -1).amax(1);  // [B]
    cache.shift_later_positions(largest + 1 - kept.sum(1));
  } else {
    positions = layout.positions.unsqueeze(0).expand({3, -1, -1});
  }
  const auto embeds = prompt ? embeddings(input_ids, step.vision) : embeddings(input_ids, {}, /*generated=*/true);
  const auto hidden = (*model_)(embeds, positions, layout, cache);  // [B, T, C]
  return (*lm_head_)(hidden.select(1, hidden.size(1) - 1));  // [B, V]
}

KvCache VisionLanguageLM::generation_cache(int64_t capacity) const {
  return KvCache(model_->layer_count(), capacity, /*window=*/0);
}

torch::Tensor VisionLanguageLM::hidden(const torch::Tensor& input_ids, const VisionInputs& vision,
                                       const RowLayout& layout) {
  if (layout.positions.defined()) {
    throw UserError(class_name() + " places its tokens itself (multimodal RoPE positions from the images' grids): "
                    "give no position_ids");
  }
  const auto positions = position_ids(input_ids, vision, layout.offsets);  // [3, B, T]
  return (*model_)(embeddings(input_ids, vision), positions, to_device(layout.offsets, input_ids.device()));
}

torch::Tensor VisionLanguageLM::embeddings(const torch::Tensor& input_ids, const VisionInputs& vision, bool generated) {
  const int64_t merge = visual_->config().spatial_merge_size;
  const int64_t image_tokens = merged_tokens(vision.image_grid_thw, merge);
  const int64_t video_tokens = merged_tokens(vision.video_grid_thw, merge);
  auto image_mask = input_ids == config().image_token_id;  // [B, T]
  auto video_mask = input_ids == config().video_token_id;
  for (auto [what, mask, expected] : {std::tuple{"image", image_mask, image_tokens}, {"video", video_mask, video_tokens}}) {
    const int64_t found = generated ? expected : mask.sum().item<int64_t>();
    if (found != expected) {
      throw UserError(std::string(what) + " placeholders: the tokens hold " + std::to_string(found) +
                      " but the grids give " + std::to_string(expected) + " merged patches");
    }
  }
  auto embeds = (*model_->embed_tokens)(input_ids);  // [B, T, C]
  if (image_tokens + video_tokens == 0) {
    // The tower runs on every batch, so when its blocks are sharded every rank gathers and
    // reduces them in lockstep whatever its batch holds: a batch without images or video
    // sends one blank m × m frame through it and adds its features times zero, which leaves
    // the logits and every gradient as they are.
    const VisionConfig& v = visual_->config();
    auto grid = at::tensor({int64_t{1}, merge, merge}, at::kLong).view({1, 3});
    auto blank = at::zeros({merge * merge, v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size},
                           embeds.options());
    return embeds + 0.0 * (*visual_)(blank, grid).sum().to(embeds.scalar_type());
  }
  // Images and videos go through the tower together, once per batch.
  std::vector<torch::Tensor> patches, grids;
  if (image_tokens > 0) patches.push_back(vision.pixel_values), grids.push_back(vision.image_grid_thw);
  if (video_tokens > 0) patches.push_back(vision.pixel_values_videos), grids.push_back(vision.video_grid_thw);
  auto features = (*visual_)(at::cat(patches), at::cat(grids)).to(embeds.scalar_type());  // [I + V tokens, C]
  if (image_tokens > 0) {
    embeds = embeds.masked_scatter(image_mask.unsqueeze(-1).expand_as(embeds), features.narrow(0, 0, image_tokens));
  }
  if (video_tokens > 0) {
    embeds = embeds.masked_scatter(video_mask.unsqueeze(-1).expand_as(embeds), features.narrow(0, image_tokens, video_tokens));
  }
  return embeds;
}

torch::Tensor VisionLanguageLM::position_ids(const torch::Tensor& input_ids, const VisionInputs& vision,
                                             const torch::Tensor& documents) const {
  return multimodal_positions(config(), input_ids, vision, documents).to(input_ids.device());
}

}  // namespace fsdpp
