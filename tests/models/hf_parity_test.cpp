// Parity with Hugging Face transformers: tiny random checkpoints that transformers made
// (tests/reference/make_hf_fixtures.py) load into the engine and give the same fp32 logits,
// loss and gradients, and the same parameters after global-norm clipping and one AdamW
// step as torch.optim.AdamW, within 1e-5 of the reference's largest magnitude.
#include "core/module_tree.h"
#include "data/evaluate.h"
#include "io/model_source.h"
#include "io/safetensors.h"
#include "loss/next_token_loss.h"
#include "models/moe.h"
#include "models/qwen_vl.h"
#include "optim/adamw.h"
#include "tensor_checks.h"

#include <catch2/catch.hpp>

using namespace fsdpp;

namespace {

// Targets [B, T] for `ids` [B, T] as transformers takes labels = input_ids: each token
// predicts the next, the last predicts nothing.
at::Tensor next_tokens(const at::Tensor& ids) {
  auto targets = at::full_like(ids, -100);
  targets.narrow(1, 0, ids.size(1) - 1).copy_(ids.narrow(1, 1, ids.size(1) - 1));
  return targets;
}

// The mean next-token loss of `logits` [B, T, V] over `targets` [B, T] (-100: none), plus the
// value of `extra_loss` where defined (a loss whose gradient the model's backward adds by
// itself), checked against the reference's `loss_key`, then backward and every gradient
// against the reference's "<grad_prefix><name>" entries: each one the reference has, and no
// more.
void check_loss_and_gradients(Module& model, const at::Tensor& logits, const at::Tensor& targets,
                              const SafetensorsFile& reference, const std::string& loss_key,
                              const std::string& grad_prefix = "grad.", const at::Tensor& extra_loss = {}) {
  auto loss = next_token_loss_sum(logits, targets) / (targets != -100).sum().item<double>();
  if (extra_loss.defined()) loss = loss + extra_loss;
  CHECK(relative_error(loss, reference.tensor(loss_key)) < 1e-5);
  loss.backward();
  int checked = 0;
  for (const auto& p : unique_named_parameters(model)) {
    if (!p.tensor.requires_grad()) continue;  // DeepSeek-V3's routing bias: a buffer there
    INFO("gradient of " << p.name);
    REQUIRE(reference.contains(grad_prefix + p.name));
    CHECK(relative_error(p.tensor.grad(), reference.tensor(grad_prefix + p.name)) < 1e-5);
    ++checked;
  }
  int expected = 0;
  for (const auto& [name, entry] : reference.entries()) expected += name.starts_with(grad_prefix);
  CHECK(checked == expected);
}

// Where the fixture `name` lies (tests/CMakeLists.txt's hf_fixtures makes them).
std::string fixture_dir(const std::string& name) {
  const char* fixtures = std::getenv("FSDPP_FIXTURE_DIR");
  REQUIRE(fixtures != nullptr);
  return std::string(fixtures) + "/" + name;
}

// A fixture's model in float32 and its reference outputs.
std::pair<std::shared_ptr<CausalLM>, std::shared_ptr<SafetensorsFile>> load_fixture(const std::string& model_name) {
  const std::string dir = fixture_dir(model_name);
  return {load_model({.path = dir, .dtype = at::kFloat}).model, SafetensorsFile::open(dir + "/reference.safetensors")};
}

// A MoE model's routing in its last forward against transformers' (the experts each layer
// chose for each token), and Qwen3-MoE's weighted load-balancing loss, which transformers'
// training loss includes: added to the coming backward, its value returned (undefined for
// models without one).
at::Tensor check_routing(const CausalLM& model, const SafetensorsFile& reference) {
  RoutingLog* routing = model.routing();
  if (routing == nullptr) return {};
  REQUIRE(!routing->layers.empty());
  at::Tensor counts = at::zeros_like(routing->layers.front().counts);  // [E] over the layers
  double rows = 0;
  for (size_t i = 0; i < routing->layers.size(); ++i) {
    INFO("MoE layer " << i);
    const auto& layer = routing->layers[i];
    CHECK(at::equal(std::get<0>(layer.selected.sort(-1)), reference.tensor("selected." + std::to_string(i))));
    counts += layer.counts;
    rows += static_cast<double>(layer.selected.size(0));
  }
  const double weight = model.config().moe->router_aux_loss_coef;
  CHECK(reference.contains("aux_loss") == (weight > 0));
  if (weight == 0) return {};
  const auto weighted = add_load_balancing_loss(*routing, counts, at::full({1}, rows, at::kDouble), weight);
  CHECK(relative_error(weighted / weight, reference.tensor("aux_loss")) < 1e-5);
  return weighted;
}

}  // namespace

TEST_CASE("logits, loss and gradients match transformers", "[models][parity]") {
  const std::string model_name = GENERATE("llama_untied", "llama_tied_rope3", "qwen2", "qwen3", "mistral",
                                          "qwen3_moe", "qwen3_moe_unnormed", "deepseek_v3", "deepseek_v3_plain",
                                          "llama_sharded", "llama_yarn_pad", "deepseek_v3_linear");
  INFO("model " << model_name);
  auto [model, reference] = load_fixture(model_name);

  auto ids = reference->tensor("input_ids");  // [B, T]
  auto logits = (*model)(ids);                // [B, T, V]
  CHECK(relative_error(logits, reference->tensor("logits")) < 1e-5);
  const auto aux_loss = check_routing(*model, *reference);
  check_loss_and_gradients(*model, logits, next_tokens(ids), *reference, "loss", "grad.", aux_loss);

  // The optimizer starts from transformers' own gradients: Adam's first step is about
  // lr * g / (|g| + eps), so where g is near zero it would magnify rounding in the gradients
  // and blur what this checks. Constants as in make_hf_fixtures.py.
  std::vector<at::Tensor> params;
  for (const auto& p : unique_named_parameters(*model)) {
    if (!p.tensor.requires_grad()) continue;
    p.tensor.mutable_grad() = reference->tensor("grad." + p.name).clone();
    params.push_back(p.tensor);
  }
  const GradClip clip = clip_by_norm({{.params = params}}, 0.5);
  CHECK(clip.norm.item<double>() == Approx(reference->tensor("grad_norm").item<double>()).epsilon(1e-5));
  const OptimizerConfig adamw{.lr = 1e-2, .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
  AdamW optimizer(decay_groups(unique_named_parameters(*model), adamw.weight_decay), adamw);
  optimizer.step(adamw.lr, clip);
  for (const auto& p : unique_named_parameters(*model)) {
    if (!p.tensor.requires_grad()) continue;
    INFO("updated " << p.name);
    CHECK(relative_error(p.tensor.detach(), reference->tensor("updated." + p.name)) < 1e-5);
  }
}

// Rows packing several documents (make_hf_fixtures.py's packed_reference): the logits of every
// document as transformers gives for it alone, and the loss and gradients over all targets and
// over those a loss mask marks.
TEST_CASE("packed documents give what each document gives alone through transformers", "[models][parity]") {
  const std::string model_name = GENERATE("llama_untied", "llama_tied_rope3", "qwen2", "qwen3", "mistral",
                                          "qwen3_moe", "deepseek_v3", "llama_yarn_pad");
  const bool masked = GENERATE(false, true);
  INFO("model " << model_name << (masked ? ", loss mask" : ""));
  auto [model, reference] = load_fixture(model_name);

  auto ids = reference->tensor("packed.input_ids");  // [R, T]
  auto logits = (*model)(ids, RowLayout{reference->tensor("packed.offsets")});  // [R, T, V]
  // Padding positions have no reference; the documents' positions are all the rest.
  auto expected = reference->tensor("packed.logits");
  auto in_document = expected.abs().sum(-1) > 0;  // [R, T]
  CHECK(relative_error(logits.detach().index({in_document}), expected.index({in_document})) < 1e-5);
  auto targets = reference->tensor("packed.targets");
  const std::string variant = masked ? "packed_masked" : "packed";
  if (masked) targets = targets.masked_fill(reference->tensor("packed.marked").logical_not(), -100);
  check_loss_and_gradients(*model, logits, targets, *reference, variant + ".loss", variant + ".grad.");
}

// LoRA (tests/reference/make_lora_fixtures.py): a base model with a PEFT adapter (rank 3 or 5,
// targets in attention and the MLP, and for Qwen2 its final norm trained too) gives peft's
// logits, loss and gradients of everything that trains; the frozen base gets none.
TEST_CASE("LoRA adapters give peft's logits, loss and gradients", "[models][parity]") {
  const std::string name = GENERATE("lora_llama", "lora_qwen2");
  INFO("fixture " << name);
  const std::string dir = fixture_dir(name);
  auto loaded = load_model({.path = dir + "/base", .dtype = at::kFloat, .adapter = dir + "/adapter"});
  const auto reference = SafetensorsFile::open(dir + "/reference.safetensors");
  auto ids = reference->tensor("input_ids");
  auto logits = (*loaded.model)(ids);
  CHECK(relative_error(logits, reference->tensor("logits")) < 1e-5);
  check_loss_and_gradients(*loaded.model, logits, next_tokens(ids), *reference, "loss");
  int frozen = 0;
  for (const auto& p : unique_named_parameters(*loaded.model)) {
    if (p.tensor.requires_grad()) continue;
    INFO("frozen " << p.name);
    CHECK(!p.tensor.grad().defined());
    ++frozen;
  }
  CHECK(frozen > 0);
}

// Qwen2-VL and Qwen2.5-VL (tests/reference/make_vl_fixtures.py): text, image, video and
// image-plus-video batches give transformers' fp32 logits; the last also its loss and every
// gradient, vision tower included.
TEST_CASE("Qwen2-VL and Qwen2.5-VL logits and gradients match transformers for text, images and video",
          "[models][parity]") {
  const std::string model_name = GENERATE("qwen2_vl", "qwen2_5_vl", "qwen2_vl_yarn");
  INFO("model " << model_name);
  auto [loaded, reference] = load_fixture(model_name);
  auto* model = dynamic_cast<VisionLanguageLM*>(loaded.get());
  REQUIRE(model != nullptr);
  auto optional = [&](const std::string& key) { return reference->contains(key) ? reference->tensor(key) : at::Tensor(); };
  for (const std::string name : {"text", "image", "video", "image_video"}) {
    INFO("batch " << name);
    auto ids = reference->tensor(name + ".input_ids");  // [B, T]
    const VisionInputs vision{optional(name + ".pixel_values"), optional(name + ".image_grid_thw"),
                              optional(name + ".pixel_values_videos"), optional(name + ".video_grid_thw"),
                              optional(name + ".second_per_grid_ts")};
    auto logits = (*model)(ids, vision, RowLayout{});  // [B, T, V]
    CHECK(relative_error(logits, reference->tensor(name + ".logits")) < 1e-5);
    if (name == "image_video") check_loss_and_gradients(*model, logits, next_tokens(ids), *reference, "image_video.loss");
  }
}
