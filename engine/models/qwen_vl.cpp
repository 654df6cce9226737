// Qwen2-VL's and Qwen2.5-VL's forward: one pass of the vision tower over the batch's
// images and videos together, their features scattered into the placeholder embeddings,
// and the decoder run with multimodal RoPE positions.
#include "models/qwen_vl.h"

#include "core/error.h"

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
  return forward(input_ids, VisionInputs{});
}

torch::Tensor VisionLanguageLM::forward(const torch::Tensor& input_ids, const VisionInputs& vision) {
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
  if (image_tokens + video_tokens == 0) {
    // The tower runs on every batch, so when its blocks are sharded every rank gathers and
    // reduces them in lockstep whatever its batch holds: a batch without images or video
    // sends one blank m × m frame through it and adds its features times zero, which leaves
    // the logits and every gradient as they are.
    const VisionConfig& v = visual_->config();
    auto grid = at::tensor({int64_t{1}, merge, merge}, at::kLong).view({1, 3});
    auto blank = at::zeros({merge * merge, v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size},
                           embeds.options());
    embeds = embeds + 0.0 * (*visual_)(blank, grid).sum().to(embeds.scalar_type());
  } else {
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
  return (*lm_head_)((*model_)(embeds, position_ids(input_ids, vision), torch::Tensor()));
}

torch::Tensor VisionLanguageLM::position_ids(const torch::Tensor& input_ids,
                                                            const VisionInputs& vision) const {
  const int64_t B = input_ids.size(0), T = input_ids.size(1), merge = visual_->config().spatial_merge_size;
  auto ids = input_ids.to(at::kCPU, at::kLong).contiguous();  // read on the host, element by element
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
      // A video's frame f sits at f × tokens_per_second × its seconds per temporal patch
      // (Qwen2.5-VL; 1 second where the batch gives none), in float32 and truncated, as
      // transformers computes it; Qwen2-VL's frames and every image step by 1.
      float frame_step = 1.0F;
      if (video && visual_->config().windowed) {
        const float seconds =
            vision.second_per_grid_ts.defined() ? vision.second_per_grid_ts[index - 1].item<float>() : 1.0F;
        frame_step = static_cast<float>(visual_->config().tokens_per_second) * seconds;
      }
      for (int64_t f = 0; f < frames; ++f) {
        const auto frame = static_cast<int64_t>(static_cast<float>(f) * frame_step);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c, ++t) {
            TORCH_CHECK(t < T, "a vision block runs past the end of the sequence");
            pos[0][b][t] = next + frame, pos[1][b][t] = next + r, pos[2][b][t] = next + c;
          }
        }
      }
      // Text resumes past the block's rows and columns, whatever its frames span: transformers
      // 5's placement (4.x resumed past the largest position, a long video's frames included).
      next += std::max(rows, cols);
    }
  }
  return out.to(input_ids.device());
}

}  // namespace fsdpp
