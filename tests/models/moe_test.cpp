// Expert compute: all experts in one grouped product give what one product per expert gives
// (the path the engine takes when experts cannot be grouped), on the CPU and, when the test
// runs on one, the GPU, whose bf16 product is a grouped GEMM kernel. Experts that receive no
// token get zero gradients from the grouped product, as every rank must reduce them. Experts
// whose weights lie one stride apart in one buffer, as a unit's gathered buffer lays them, are
// read where they lie rather than stacked into a copy. On a GPU, a layer's forward and backward
// never wait for the device.
#include "core/module_tree.h"
#include "metrics/op_count.h"
#include "models/moe.h"
#include "models/registry.h"
#include "device_waits.h"
#include "tensor_checks.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <optional>

using namespace fsdpp;

namespace {

constexpr const char* kExpertsPrefix = "model.layers.0.mlp.experts.";

// One Qwen3-MoE layer of 8 experts, each token routed to 2.
ModelConfig small_moe_config() {
  return ModelConfig::from_json(
      {{"model_type", "qwen3_moe"}, {"vocab_size", 50}, {"hidden_size", 32}, {"intermediate_size", 40},
       {"num_hidden_layers", 1}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 8},
       {"num_experts", 8}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 24}, {"norm_topk_prob", true}},
      "moe_test");
}

struct Pass {
  at::Tensor logits;                          // [B, T, V] in float32
  std::map<std::string, at::Tensor> grads;    // by parameter name
  bool grouped = false;                       // whether the grouped product ran
};

Pass forward_backward(CausalLM& model, const at::Tensor& ids) {
  for (const auto& p : unique_named_parameters(model)) p.tensor.mutable_grad() = at::Tensor();
  auto logits = model(ids);  // [B, T, V]
  Pass pass{.logits = logits.detach().to(at::kFloat), .grouped = backward_runs(logits, "GroupedProjection")};
  logits.to(at::kFloat).square().mean().backward();
  for (const auto& p : unique_named_parameters(model)) {
    if (p.tensor.grad().defined()) pass.grads[p.name] = p.tensor.grad().to(at::kFloat);
  }
  return pass;
}

// Moves the experts' weights into one buffer, in the order the model registers them (a unit's
// order), with `gap` elements left after the first expert's: 0 lays every expert's projection
// one stride from the last expert's, as a unit's gathered buffer does.
at::Tensor lay_out_experts(CausalLM& model, int64_t gap) {
  std::vector<at::Tensor> weights;
  for (const auto& p : unique_named_parameters(model)) {
    if (p.name.starts_with(kExpertsPrefix)) weights.push_back(p.tensor);
  }
  int64_t total = gap;
  for (const auto& w : weights) total += w.numel();
  at::Tensor buffer = at::empty({total}, weights.front().options());
  int64_t offset = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    at::NoGradGuard no_grad;
    at::Tensor region = buffer.narrow(0, offset, weights[i].numel()).view(weights[i].sizes());
    region.copy_(weights[i]);
    weights[i].set_data(region);
    offset += weights[i].numel() + (i == 2 ? gap : 0);  // after expert 0's gate, up and down
  }
  return buffer;
}

// Both paths round the same products, in another order of sums. In float32 the bound is
// measured where the test runs: ten times the farthest one product per expert lies from the
// same weights in float64 (whose experts compute one product each), over the logits and
// every gradient; on this CPU the paths are 1.1e-6 apart. In bf16, whose router may choose
// otherwise than float64's, it is derived: an order of sums moves a bf16 rounding by at most
// one ulp (2^-7 relative), over at most five roundings in a row (three products, SwiGLU's
// product, the weighted sum). On this CPU the bf16 paths are identical.
double path_bound(const ModelConfig& config, CausalLM& model, const at::Tensor& ids, const Pass& per_expert,
                  at::ScalarType dtype) {
  if (dtype != at::kFloat) return 5 * std::ldexp(1.0, -7);
  const Pass truth = forward_backward(*float64_twin(config, model), ids);
  double noise = relative_error(per_expert.logits, truth.logits);
  for (const auto& [name, grad] : per_expert.grads) noise = std::max(noise, relative_error(grad, truth.grads.at(name)));
  INFO("rounding noise " << noise);
  REQUIRE(noise < 1e-4);  // more is no rounding: float64 routed otherwise
  return 10 * noise;
}

// Frozen experts (those under `prefix`: one, or a LoRA run's whole base) still run grouped,
// get no gradient, and leave every other gradient as it was (up to the order of a GPU's
// atomic sums).
void check_frozen_experts(CausalLM& model, const at::Tensor& ids, const Pass& grouped, double bound,
                          const std::string& prefix) {
  for (const auto& p : unique_named_parameters(model)) {
    if (p.name.starts_with(prefix)) p.tensor.requires_grad_(false);
  }
  const Pass frozen = forward_backward(model, ids);
  CHECK(frozen.grouped);
  for (const auto& [name, grad] : grouped.grads) {
    INFO("gradient of " << name << " with " << prefix << "* frozen");
    CHECK(frozen.grads.count(name) == !name.starts_with(prefix));
    if (frozen.grads.count(name)) CHECK(relative_error(frozen.grads.at(name), grad) < bound);
  }
}

// The two paths' gradients agree within `bound`; only an idle expert's weights have no
// gradient at all, in both. Returns how many weights that leaves without one.
int check_same_gradients(const Pass& grouped, const Pass& per_expert, const at::Tensor& counts, double bound) {
  REQUIRE(grouped.grads.size() == per_expert.grads.size());
  int idle = 0;
  for (const auto& [name, grad] : per_expert.grads) {
    INFO("gradient of " << name);
    REQUIRE(grouped.grads.count(name));
    const auto& from_grouped = grouped.grads.at(name);
    if (from_grouped.abs().max().item<double>() == 0) {
      REQUIRE(name.starts_with(kExpertsPrefix));
      CHECK(counts[std::stoi(name.substr(std::string(kExpertsPrefix).size()))].item<int64_t>() == 0);
      CHECK(grad.abs().max().item<double>() == 0);
      ++idle;
      continue;
    }
    CHECK(relative_error(from_grouped, grad) < bound);
  }
  return idle;
}

}  // namespace

TEST_CASE("experts in one grouped product equal one product per expert, idle experts included", "[models][gpu]") {
  const bool on_gpu = GENERATE(false, true);
  if (on_gpu && !gpu_half_runs()) return;
  const c10::Device device = on_gpu ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  const auto dtype = GENERATE(at::kFloat, at::kBFloat16);
  // 8 experts, each token routed to 2: 3 tokens leave at least two experts without any; 64
  // tokens give some expert more rows than one 16-row block of the grouped product.
  const int64_t tokens = GENERATE(3, 64);
  INFO(device << " " << dtype << ", " << tokens << " tokens");
  const auto config = small_moe_config();
  auto model = build_model(config, torch::TensorOptions().dtype(dtype).device(device));
  init_parameters(*model, /*seed=*/11, /*std=*/0.2);
  at::manual_seed(tokens);
  const auto ids = at::randint(0, 50, {1, tokens}, at::TensorOptions(at::kLong).device(device));  // [B, T]

  const Pass grouped = forward_backward(*model, ids);
  // A GPU groups bf16 alone: float32 would take ATen's loop, which syncs at every product.
  REQUIRE(grouped.grouped == (!on_gpu || dtype == at::kBFloat16));
  if (!grouped.grouped) return;
  const auto counts = model->routing()->layers.at(0).counts;  // [E]
  // A hook on every expert makes each one a module call of its own: one product per expert.
  std::vector<std::pair<Module*, int>> hooks;
  for (int64_t e = 0; e < 8; ++e) {
    Module* expert = find_module(*model, kExpertsPrefix + std::to_string(e));
    hooks.emplace_back(expert, expert->add_pre_forward_hook([](Module&, Module::Tensors&) {}));
  }
  const Pass per_expert = forward_backward(*model, ids);
  REQUIRE_FALSE(per_expert.grouped);
  CHECK(at::equal(model->routing()->layers.at(0).counts, counts));

  const double bound = path_bound(config, *model, ids, per_expert, dtype);
  for (auto [expert, id] : hooks) expert->remove_hook(id);
  check_frozen_experts(*model, ids, grouped, bound, kExpertsPrefix + std::string("0."));
  check_frozen_experts(*model, ids, grouped, bound, kExpertsPrefix);

  CHECK(relative_error(grouped.logits, per_expert.logits) < bound);
  const int idle = check_same_gradients(grouped, per_expert, counts, bound);
  const int64_t idle_experts = (counts == 0).sum().item<int64_t>();
  CHECK(idle == 3 * idle_experts);
  if (tokens == 3) {
    CHECK(idle_experts >= 2);
  } else {
    CHECK(counts.max().item<int64_t>() > 16);
  }
}

TEST_CASE("experts one stride apart run their grouped product in place, with the values of a stacked copy",
          "[models][gpu]") {
  const bool on_gpu = GENERATE(false, true);
  if (on_gpu && !gpu_half_runs()) return;
  const c10::Device device = on_gpu ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  const auto dtype = on_gpu ? at::kBFloat16 : GENERATE(at::kFloat, at::kBFloat16);
  INFO(device << " " << dtype);
  const auto config = small_moe_config();
  auto model = build_model(config, torch::TensorOptions().dtype(dtype).device(device));
  init_parameters(*model, /*seed=*/5, /*std=*/0.2);
  at::manual_seed(5);
  const auto ids = at::randint(0, 50, {2, 32}, at::TensorOptions(at::kLong).device(device));  // [B, T]

  // 8 elements (16 or 32 bytes) after the first expert: the others no longer lie one stride
  // from it, and their weights are stacked.
  const at::Tensor uneven = lay_out_experts(*model, /*gap=*/8);
  std::optional<OpCounter> counter(std::in_place);
  const Pass stacked = forward_backward(*model, ids);
  const OpCounts stacked_counts = counter->stop();
  counter.reset();

  const at::Tensor even = lay_out_experts(*model, /*gap=*/0);
  counter.emplace();
  const Pass in_place = forward_backward(*model, ids);
  const OpCounts in_place_counts = counter->stop();

  REQUIRE(stacked.grouped);
  REQUIRE(in_place.grouped);
  // Each of the three projections stacks its weights in forward and again in backward for
  // its input's gradient (the weights' own gradients read no weight): six stacks, or none
  // (besides the rotary tables' one).
  const auto stacks = [](const OpCounts& counts) {
    return counts.by_op.count("aten::stack") ? counts.by_op.at("aten::stack").calls : 0;
  };
  CHECK(stacks(stacked_counts) - stacks(in_place_counts) == 6);
  CHECK(in_place_counts.other_bytes < stacked_counts.other_bytes);
  // The same products of the same operands.
  CHECK(at::equal(in_place.logits, stacked.logits));
  REQUIRE(in_place.grads.size() == stacked.grads.size());
  for (const auto& [name, grad] : stacked.grads) {
    INFO("gradient of " << name);
    CHECK(at::equal(in_place.grads.at(name), grad));
  }
}

#ifdef FSDPP_TESTS_SEE_DEVICE_WAITS
TEST_CASE("a MoE layer's forward and backward on a GPU never wait for the device", "[models][gpu]") {
  if (!gpu_half_runs()) return;
  const c10::Device gpu(c10::kCUDA, 0);
  auto model = build_model(small_moe_config(), torch::TensorOptions().dtype(at::kBFloat16).device(gpu));
  init_parameters(*model, /*seed=*/3, /*std=*/0.2);
  auto* block = dynamic_cast<MoeBlock*>(find_module(*model, "model.layers.0.mlp"));
  REQUIRE(block != nullptr);
  at::manual_seed(3);
  // 3 tokens leave experts idle; 64 give some expert more than one 16-row block.
  for (const int64_t tokens : {3, 64}) {
    INFO(tokens << " tokens");
    const auto x = at::randn({1, tokens, 32}, at::TensorOptions(at::kBFloat16).device(gpu)).requires_grad_(true);
    {
      DeviceWaitsRaise raise;
      const auto out = block->forward(x);  // [1, T, C]
      CHECK(backward_runs(out, "GroupedProjection"));
      out.to(at::kFloat).square().mean().backward();
    }
    CHECK(x.grad().isfinite().all().item<bool>());
    CHECK(model->routing()->layers.at(0).counts.sum().item<int64_t>() == 2 * tokens);
  }
}
#endif
