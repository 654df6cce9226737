// The sections of a config.json beyond the decoder's own widths: RoPE scaling, the vision
// tower, routed experts (Qwen3-MoE, DeepSeek-V3) and latent attention. Each reader applies
// transformers' defaults and checks every value's range; errors name the file and key.
#pragma once

#include "models/model_config.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>

namespace fsdpp {

// rope_scaling (or rope_parameters in newer files); defaults when neither is an object.
RopeScaling read_rope_scaling(const nlohmann::json& j, const std::string& origin);

// vision_config of a Qwen2-VL or Qwen2.5-VL file.
VisionConfig read_vision(const nlohmann::json& j, const std::string& model_type, const std::string& origin);

// The experts of a qwen3_moe and a deepseek_v3 file with `layers` decoder layers.
MoeConfig read_qwen3_moe(const nlohmann::json& j, int64_t layers, const std::string& origin);
MoeConfig read_deepseek_moe(const nlohmann::json& j, int64_t layers, const std::string& origin);

// DeepSeek-V3's attention widths.
LatentAttentionConfig read_latent_attention(const nlohmann::json& j, const std::string& origin);

}  // namespace fsdpp
