// Qwen2-VL's forward: one pass of the vision tower over the batch's images and videos
// together, their features scattered into the placeholder embeddings, and the decoder run
// with multimodal RoPE positions.
#include "models/qwen2_vl.h"

#include "core/error.h"

#include <ATen/ATen.h>

namespace fsdpp {

namespace {

int64_t merged_tokens(const torch::Tensor& grid_thw, int64_t merge) {
  return grid_thw.defined() && grid_thw.numel() > 0 ? grid_thw.prod(1).sum().item<int64_t>() / (merge * merge) : 0;
}

}  // namespace

Qwen2VLForConditionalGeneration::Qwen2VLForConditionalGeneration(const ModelConfig& c, const torch::TensorOptions& opts)
    : CausalLM("Qwen2VLForConditionalGeneration", c, {"Qwen2VLDecoderLayer", "Qwen2VLVisionBlock"}) {
  TORCH_CHECK(c.vision, "Qwen2-VL needs a vision_config");
  visual_ = register_child("visual", std::make_shared<VisionTransformer>(*c.vision, opts));
  model_ = register_child("model", std::make_shared<DecoderModel>(DecoderFamily{.prefix = "Qwen2VL", .qkv_bias = true}, c,
                                                                  opts, "Qwen2VLTextModel"));
  lm_head_ = c.tie_word_embeddings ? std::make_shared<Linear>(model_->embed_tokens->weight)
                                   : std::make_shared<Linear>(c.hidden_size, c.vocab_size, false, opts);
  register_child("lm_head", lm_head_);
}

torch::Tensor Qwen2VLForConditionalGeneration::forward(const torch::Tensor& input_ids) {
  return forward(input_ids, VisionInputs{});
}

torch::Tensor Qwen2VLForConditionalGeneration::forward(const torch::Tensor& input_ids, const VisionInputs& vision) {
  const int64_t merge = visual_->config().spatial_merge_size;
  const int64_t image_tokens = merged_tokens(vision.image_grid_thw, merge);
  const int64_t video_tokens = merged_tokens(vision.video_grid_thw, merge);
  auto image_mask = input_ids == config().image_token_id;  // [B, T]
  auto video_mask = input_ids == config().video_token_id;
  for (auto [what, mask, expected] : {std::tuple{"image", image_mask, image_tokens}, {"video", video_mask, video_tokens}}) {
    const int64_t found = mask.sum().item<int64_t>();
    if (found != expected) {
      throw UserError(std::string(what) + " placeholders: the tokens hold " + std::to_string(found) +
                      " but the grids give " + std::to_string(expected) + " merged patches");
    }
  }
  auto embeds = (*model_->embed_tokens)(input_ids);  // [B, T, C]
  if (image_tokens + video_tokens > 0) {
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
  }
  return (*lm_head_)((*model_)(embeds, position_ids(input_ids, vision)));
}

torch::Tensor Qwen2VLForConditionalGeneration::position_ids(const torch::Tensor& input_ids,
                                                            const VisionInputs& vision) const {
  const int64_t B = input_ids.size(0), T = input_ids.size(1), merge = visual_->config().spatial_merge_size;
  auto ids = input_ids.to(at::kLong).contiguous();
  auto out = at::empty({3, B, T}, at::kLong);
  auto id = ids.accessor<int64_t, 2>();
  auto pos = out.accessor<int64_t, 3>();
  int64_t next_image = 0, next_video = 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t next = 0;  // the position the next text token takes
    for (int64_t t = 0; t < T;) {
      const bool image = id[b][t] == config().image_token_id, video = id[b][t] == config().video_token_id;
      if (!image && !video) {
        for (int a = 0; a < 3; ++a) pos[a][b][t] = next;
        ++next, ++t;
        continue;
      }
      const torch::Tensor& grids = image ? vision.image_grid_thw : vision.video_grid_thw;
      int64_t& index = image ? next_image : next_video;
      TORCH_CHECK(grids.defined() && index < grids.size(0), "more vision placeholders than grids");
      const int64_t frames = grids[index][0].item<int64_t>(), rows = grids[index][1].item<int64_t>() / merge,
                    cols = grids[index][2].item<int64_t>() / merge;
      ++index;
      int64_t largest = next;
      for (int64_t f = 0; f < frames; ++f) {
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c, ++t) {
            TORCH_CHECK(t < T, "a vision block runs past the end of the sequence");
            pos[0][b][t] = next + f, pos[1][b][t] = next + r, pos[2][b][t] = next + c;
            largest = std::max({largest, next + f, next + r, next + c});
          }
        }
      }
      next = largest + 1;
    }
  }
  return out.to(input_ids.device());
}

}  // namespace fsdpp
