// Fuzzes a multimodal dataset's samples.jsonl against a small Qwen2-VL model
// (tests/tiny_qwen2_vl_config.h) whose pixels.safetensors holds one image of grid [1, 4, 4]
// and one video of grid [2, 4, 4].
#include "data/sample_index.h"
#include "fuzz_case.h"
#include "tests/tiny_qwen2_vl_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const fsdpp::ModelConfig model =
      fsdpp::ModelConfig::from_text(fsdpp::testing::kTinyQwen2VlConfig, "config.json");
  static const std::map<std::string, fsdpp::SafetensorsEntry> pixels = {
      {"image0", {at::kFloat, {16, 96}, 0, 16 * 96 * 4}},
      {"video0", {at::kFloat, {32, 96}, 16 * 96 * 4, 48 * 96 * 4}}};
  return fsdpp::fuzz_case(
      [&] { fsdpp::parse_samples(fsdpp::fuzz_text(data, size), "samples.jsonl", model, 64, pixels); });
}
