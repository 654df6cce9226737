// The sections of a config.json beyond the decoder's own widths: RoPE scaling, the vision
// tower, routed experts (Qwen3-MoE, DeepSeek-V3) and latent attention. Each reader applies
// transformers' defaults and checks every value's range; errors name the file and key.
#pragma once

#include "models/model_config.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace fsdpp {

// RoPE's settings as one block, as transformers reads them: rope_scaling (4.x's name) where the
// file has a non-empty one, else rope_parameters (5.x's); rope_theta and partial_rotary_factor
// from the top level where 4.x files keep them (a value given differently in both places is
// refused, naming both); original_max_position_embeddings from the top level over the
// block's. A partial rotation is refused.
struct RopeBlock {
  nlohmann::json values;  // the keys
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
