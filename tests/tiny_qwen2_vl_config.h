// The config.json of a small Qwen2-VL, for the tests that parse multimodal samples against
// it: patches of 3 x 2 x 4 x 4 = 96 values merged 2 x 2, so an image of grid [1, 4, 4] takes
// 4 placeholders (token 290; a video's are 291).
#pragma once

namespace fsdpp::testing {

inline constexpr const char* kTinyQwen2VlConfig = R"({
  "model_type": "qwen2_vl", "vocab_size": 300, "hidden_size": 48, "intermediate_size": 88,
  "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
  "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
  "image_token_id": 290, "video_token_id": 291, "vision_start_token_id": 292,
  "vision_config": {"depth": 2, "embed_dim": 24, "hidden_size": 48, "num_heads": 3, "mlp_ratio": 2,
                    "in_channels": 3, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
                    "hidden_act": "quick_gelu"}})";

}  // namespace fsdpp::testing
