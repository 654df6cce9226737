// Parity with Hugging Face transformers: tiny random checkpoints that transformers made
// (tests/reference/make_hf_fixtures.py) load into the engine and give the same fp32 logits,
// loss and gradients, and the same parameters after global-norm clipping and one AdamW
// step as torch.optim.AdamW, within 1e-5 of the reference's largest magnitude.
#include "core/module_tree.h"
#include "io/safetensors.h"
#include "models/qwen_vl.h"
#include "train/adamw.h"
#include "train/evaluate.h"
#include "train/model_source.h"

#include <catch2/catch.hpp>

using namespace fsdpp;

namespace {

double relative_error(const at::Tensor& actual, const at::Tensor& expected) {
  const double scale = expected.abs().max().item<double>();
  return (actual - expected).abs().max().item<double>() / std::max(scale, 1e-30);
}

// The mean next-token loss of `logits` [B, T, V] for `ids` [B, T], checked against the
// reference's `loss_key`, then backward and every gradient against the reference's
// "grad.<name>" entries: each one the reference has, and no more.
void check_loss_and_gradients(Module& model, const at::Tensor& logits, const at::Tensor& ids,
                              const SafetensorsFile& reference, const std::string& loss_key) {
  const int64_t B = ids.size(0), T = ids.size(1);
  auto loss = next_token_loss_sum(logits.narrow(1, 0, T - 1), ids.narrow(1, 1, T - 1)) /
              static_cast<double>(B * (T - 1));
  CHECK(relative_error(loss, reference.tensor(loss_key)) < 1e-5);
  loss.backward();
  int checked = 0;
  for (const auto& p : unique_named_parameters(model)) {
    INFO("gradient of " << p.name);
    REQUIRE(reference.contains("grad." + p.name));
    CHECK(relative_error(p.tensor.grad(), reference.tensor("grad." + p.name)) < 1e-5);
    ++checked;
  }
  int expected = 0;
  for (const auto& [name, entry] : reference.entries()) expected += name.starts_with("grad.");
  CHECK(checked == expected);
}

}  // namespace

TEST_CASE("logits, loss and gradients match transformers", "[models][parity]") {
  const std::string model_name = GENERATE("llama_untied", "llama_tied_rope3", "qwen2", "qwen3",
                                          "llama_sharded");
  INFO("model " << model_name);
  const char* fixtures = std::getenv("FSDPP_FIXTURE_DIR");
  REQUIRE(fixtures != nullptr);
  const std::string dir = std::string(fixtures) + "/" + model_name;
  auto model = load_model({.path = dir, .dtype = "float32"}).model;
  auto reference = SafetensorsFile::open(dir + "/reference.safetensors");

  auto ids = reference->tensor("input_ids");  // [B, T]
  auto logits = (*model)(ids);                // [B, T, V]
  CHECK(relative_error(logits, reference->tensor("logits")) < 1e-5);
  check_loss_and_gradients(*model, logits, ids, *reference, "loss");

  // The optimizer starts from transformers' own gradients: Adam's first step is about
  // lr * g / (|g| + eps), so where g is near zero it would magnify rounding in the gradients
  // and blur what this checks. Constants as in make_hf_fixtures.py.
  std::vector<at::Tensor> params;
  for (const auto& p : unique_named_parameters(*model)) {
    p.tensor.mutable_grad() = reference->tensor("grad." + p.name).clone();
    params.push_back(p.tensor);
  }
  const double norm = clip_grad_norm({{.params = params}}, 0.5);
  CHECK(norm == Approx(reference->tensor("grad_norm").item<double>()).epsilon(1e-5));
  const OptimizerConfig adamw{.lr = 1e-2, .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
  AdamW optimizer(decay_groups(unique_named_parameters(*model), adamw.weight_decay), adamw);
  optimizer.step(adamw.lr);
  for (const auto& p : unique_named_parameters(*model)) {
    INFO("updated " << p.name);
    CHECK(relative_error(p.tensor.detach(), reference->tensor("updated." + p.name)) < 1e-5);
  }
}

// Qwen2-VL and Qwen2.5-VL (tests/reference/make_vl_fixtures.py): text, image, video and
// image-plus-video batches give transformers' fp32 logits; the last also its loss and every
// gradient, vision tower included.
TEST_CASE("Qwen2-VL and Qwen2.5-VL logits and gradients match transformers for text, images and video",
          "[models][parity]") {
  const std::string model_name = GENERATE("qwen2_vl", "qwen2_5_vl");
  INFO("model " << model_name);
  const char* fixtures = std::getenv("FSDPP_FIXTURE_DIR");
  REQUIRE(fixtures != nullptr);
  const std::string dir = std::string(fixtures) + "/" + model_name;
  auto loaded = load_model({.path = dir, .dtype = "float32"}).model;
  auto* model = dynamic_cast<VisionLanguageLM*>(loaded.get());
  REQUIRE(model != nullptr);
  auto reference = SafetensorsFile::open(dir + "/reference.safetensors");
  auto optional = [&](const std::string& key) { return reference->contains(key) ? reference->tensor(key) : at::Tensor(); };
  for (const std::string name : {"text", "image", "video", "image_video"}) {
    INFO("batch " << name);
    auto ids = reference->tensor(name + ".input_ids");  // [B, T]
    const VisionInputs vision{optional(name + ".pixel_values"), optional(name + ".image_grid_thw"),
                              optional(name + ".pixel_values_videos"), optional(name + ".video_grid_thw"),
                              optional(name + ".second_per_grid_ts")};
    auto logits = (*model)(ids, vision);  // [B, T, V]
    CHECK(relative_error(logits, reference->tensor(name + ".logits")) < 1e-5);
    if (name == "image_video") check_loss_and_gradients(*model, logits, ids, *reference, "image_video.loss");
  }
}
