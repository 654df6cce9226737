// Fuzzes a multimodal dataset's samples.jsonl against a small Qwen2-VL model (patches of
// 3 x 2 x 4 x 4 = 96 values, 2 x 2 merge) whose pixels.safetensors holds one image of grid
// [1, 4, 4] and one video of grid [2, 4, 4].
#include "data/sample_index.h"
#include "fuzz_case.h"

namespace {

constexpr const char* kModel = R"({
  "model_type": "qwen2_vl", "vocab_size": 300, "hidden_size": 48, "intermediate_size": 88,
  "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
  "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
  "image_token_id": 290, "video_token_id": 291, "vision_start_token_id": 292,
  "vision_config": {"depth": 2, "embed_dim": 24, "hidden_size": 48, "num_heads": 3, "mlp_ratio": 2,
                    "in_channels": 3, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
                    "hidden_act": "quick_gelu"}})";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const fsdpp::ModelConfig model = fsdpp::ModelConfig::from_text(kModel, "config.json");
  static const std::map<std::string, fsdpp::SafetensorsEntry> pixels = {
      {"image0", {at::kFloat, {16, 96}, 0, 16 * 96 * 4}},
      {"video0", {at::kFloat, {32, 96}, 16 * 96 * 4, 48 * 96 * 4}}};
  return fsdpp::fuzz_case(
      [&] { fsdpp::parse_samples(fsdpp::fuzz_text(data, size), "samples.jsonl", model, 64, pixels); });
}
