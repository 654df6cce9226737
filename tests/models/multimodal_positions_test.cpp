// Multimodal RoPE positions: a document of a packed row places its tokens as that document
// alone in a row of its own, and rows whose placeholders disagree with the grids are refused
// with the image and the row named.
#include "models/multimodal_positions.h"

#include "core/error.h"

#include "tensor_checks.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

using namespace fsdpp;

namespace {

constexpr int64_t kImage = 30, kVideo = 31;


ModelConfig qwen2_vl() {
  return ModelConfig::from_json(
      {{"model_type", "qwen2_vl"}, {"vocab_size", 37}, {"hidden_size", 24}, {"intermediate_size", 40},
       {"num_hidden_layers", 1}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
       {"image_token_id", kImage}, {"video_token_id", kVideo}, {"vision_start_token_id", 32},
       {"rope_scaling", {{"type", "mrope"}, {"mrope_section", {1, 1, 1}}}},
       {"vision_config", {{"depth", 1}, {"num_heads", 2}, {"embed_dim", 8}, {"hidden_size", 24}}}},
      "config.json");
}

// Text, one 4 x 6 image (6 merged placeholders), text: 11 tokens.
std::vector<int64_t> document() { return {1, 2, kImage, kImage, kImage, kImage, kImage, kImage, 3, 4, 5}; }

std::string refusal(const ModelConfig& config, const at::Tensor& ids, const VisionInputs& vision,
                    const at::Tensor& documents = {}) {
  try {
    multimodal_positions(config, ids, vision, documents);
  } catch (const UserError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("a packed document with an image is placed as if alone", "[models]") {
  const ModelConfig config = qwen2_vl();
  const auto one = int64s(document()).view({1, -1});  // [1, 11]
  VisionInputs vision;
  vision.image_grid_thw = int64s({1, 4, 6}).view({1, 3});
  const at::Tensor alone = multimodal_positions(config, one, vision, {});  // [3, 1, 11]
  // Text 0, 1; the image's rows and columns from 2 (2 x 3 merged); text past max(2, 3): 5, 6, 7.
  CHECK(alone[1][0].equal(int64s({0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 7})));
  CHECK(alone[2][0].equal(int64s({0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7})));

  // Two such documents in one row after 3 tokens of another: each restarts at 0.
  std::vector<int64_t> packed = {7, 8, 9};
  const std::vector<int64_t> doc = document();
  for (int copy = 0; copy < 2; ++copy) packed.insert(packed.end(), doc.begin(), doc.end());
  VisionInputs two;
  two.image_grid_thw = int64s({1, 4, 6, 1, 4, 6}).view({2, 3});
  const auto offsets = int64s({0, 3, 14, 25});
  const at::Tensor positions = multimodal_positions(config, int64s(packed).view({1, -1}), two, offsets);
  CHECK(positions.narrow(2, 0, 3).equal(at::arange(3, at::kLong).expand({3, 1, 3})));
  CHECK(positions.narrow(2, 3, 11).equal(alone));
  CHECK(positions.narrow(2, 14, 11).equal(alone));

  SECTION("an image across a document's start is refused") {
    const auto split = int64s({0, 3, 6, 25});
    CHECK(refusal(config, int64s(packed).view({1, -1}), two, split) ==
          "input_ids: image 0's grid [1, 4, 6] gives 6 placeholders, and row 0 holds a run of 6 from token 5 that "
          "crosses a document's start");
  }
}

TEST_CASE("placeholders that disagree with the grids are refused", "[models]") {
  const ModelConfig config = qwen2_vl();
  const auto ids = int64s(document()).view({1, -1});
  VisionInputs vision;
  SECTION("no grid") {
    CHECK(refusal(config, ids, vision) ==
          "input_ids: row 0 holds image placeholders at token 2 past the 0 images the grids give");
  }
  SECTION("a grid of another size") {
    vision.image_grid_thw = int64s({1, 4, 4}).view({1, 3});
    CHECK(refusal(config, ids, vision) ==
          "input_ids: image 0's grid [1, 4, 4] gives 4 placeholders, and row 0 holds a run of 6 from token 2");
  }
  SECTION("a grid the rows never use") {
    vision.image_grid_thw = int64s({1, 4, 6}).view({1, 3});
    vision.video_grid_thw = int64s({2, 2, 2}).view({1, 3});
    CHECK(refusal(config, ids, vision) == "input_ids: the grids give 1 videos and the rows hold 0 runs of their placeholders");
  }
}
