// The sections of a config.json beyond the decoder's own widths: RoPE scaling, the vision
// tower, routed experts (Qwen3-MoE, DeepSeek-V3) and latent attention. Each reader applies
// transformers' defaults and checks every value's range; errors name the file and key.
#pragma once

#include "models/model_config.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace fsdpp {

// RoPE's settings as one block: rope_parameters (transformers 5) and rope_scaling (4.x) merged,
// with rope_theta and partial_rotary_factor from the top level where 4.x files keep them. A
// key given differently in two places is refused, naming both; so is a partial rotation.
struct RopeBlock {
  nlohmann::json values;  // the merged keys
  std::string name;       // the block's name in the file, for messages
};
RopeBlock read_rope_block(const nlohmann::json& j, const std::string& origin);

// The frequency scaling of `rope`; none (rope_type "default") when it names none.
RopeScaling read_rope_scaling(const RopeBlock& rope, const std::string& origin);

// vision_config of a Qwen2-VL or Qwen2.5-VL file.
VisionConfig read_vision(const nlohmann::json& j, const std::string& model_type, const std::string& origin);

// The experts of a qwen3_moe and a deepseek_v3 file with `layers` decoder layers.
MoeConfig read_qwen3_moe(const nlohmann::json& j, int64_t layers, const std::string& origin);
MoeConfig read_deepseek_moe(const nlohmann::json& j, int64_t layers, const std::string& origin);

// DeepSeek-V3's attention widths.
LatentAttentionConfig read_latent_attention(const nlohmann::json& j, const std::string& origin);

}  // namespace fsdpp
