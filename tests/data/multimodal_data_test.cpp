// A multimodal dataset's targets: never a placeholder nor padding, and under train_on =
// "completion" nothing of a sample's prompt; the step's target count agrees with the targets,
// and completion over samples that mark no prompt is refused.
#include "core/error.h"
#include "data/multimodal_data.h"
#include "io/safetensors.h"
#include "loss/next_token_loss.h"

#include "scratch_dir.h"
#include "tiny_qwen2_vl_config.h"

#include <catch2/catch.hpp>

#include <fstream>

using namespace fsdpp;
namespace fs = std::filesystem;

namespace {

fs::path write_dataset(const std::string& name, const std::string& samples) {
  const fs::path dir = fsdpp::testing::scratch_dir("multimodal") / name;
  fs::create_directories(dir);
  std::ofstream(dir / "samples.jsonl") << samples;
  write_safetensors(dir / "pixels.safetensors", {{"image0", at::zeros({16, 96})}});
  return dir;
}

}  // namespace

TEST_CASE("a sample's prompt is no target under train_on completion, and is under all", "[train][data]") {
  const auto model = ModelConfig::from_text(fsdpp::testing::kTinyQwen2VlConfig, "config.json");
  // A prompt of 2 text tokens, the image (start, 4 placeholders, end) and a question mark;
  // then a completion of 3 tokens. A text-only sample without a prompt follows.
  const fs::path dir = write_dataset(
      "prompted", R"({"input_ids": [5, 6, 292, 290, 290, 290, 290, 293, 7, 10, 11, 12], "prompt_length": 9,)"
                  R"( "images": [{"pixels": "image0", "grid": [1, 4, 4]}]})"
                  "\n"
                  R"({"input_ids": [20, 21, 22]})"
                  "\n");
  const int64_t ignored = kIgnoredTarget;

  const auto all = MultimodalDataset::open(dir, model, 16, TrainOn::all);
  const std::vector<int64_t> learned = {6, 292, ignored, ignored, ignored, ignored, 293, 7, 10, 11, 12};
  auto expected = torch::full({16}, ignored, torch::kLong);
  expected.narrow(0, 0, 11).copy_(torch::tensor(learned, torch::kLong));
  CHECK(torch::equal(all.batch({0}).target[0], expected));
  CHECK(all.target_count({0, 1}) == 7 + 2);

  // The prompt's 9 tokens are inputs alone: the first target is the completion's first token.
  const auto completion = MultimodalDataset::open(dir, model, 16, TrainOn::completion);
  const at::Tensor targets = completion.batch({0, 1}).target;  // [2, 16]
  expected.fill_(ignored);
  expected.narrow(0, 8, 3).copy_(torch::tensor({10, 11, 12}, torch::kLong));
  CHECK(torch::equal(targets[0], expected));
  // A sample without a prompt is learned whole, as a token file's plain document is.
  CHECK(torch::equal(targets[1].narrow(0, 0, 2), torch::tensor({21, 22}, torch::kLong)));
  CHECK(completion.target_count({0, 1}) == 3 + 2);
  CHECK(completion.target_count({0, 1}) == (targets != ignored).sum().item<int64_t>());
}

TEST_CASE("completion over samples that mark no prompt, and a prompt that leaves none, are refused",
          "[train][data]") {
  const auto model = ModelConfig::from_text(fsdpp::testing::kTinyQwen2VlConfig, "config.json");
  const fs::path plain = write_dataset("plain", "{\"input_ids\": [1, 2, 3]}\n");
  CHECK_NOTHROW(MultimodalDataset::open(plain, model, 16, TrainOn::all));
  CHECK_THROWS_WITH(MultimodalDataset::open(plain, model, 16, TrainOn::completion),
                    Catch::Contains("samples.jsonl: [data] train_on = \"completion\"") &&
                        Catch::Contains("no sample marks one (\"prompt_length\""));

  for (const char* length : {"3", "-1", "1.5", "\"2\""}) {
    const fs::path bad = write_dataset("bad", std::string("{\"input_ids\": [1, 2, 3], \"prompt_length\": ") + length +
                                                  "}\n");
    CHECK_THROWS_WITH(MultimodalDataset::open(bad, model, 16, TrainOn::all),
                      Catch::Contains("samples.jsonl:1: prompt_length"));
  }
}
