// Checks the tests share: how far a tensor is from a reference and how far a fused kernel may
// be from float64, a float64 twin of a model (whose distance from a run measures that run's
// own rounding, on whatever machine runs it), which autograd node a backward runs (how a test
// knows which kernel the engine chose where both give the same numbers), and whether a [gpu]
// test's GPU half runs.
#pragma once

#include "core/module_tree.h"
#include "models/registry.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

// A 1-D int64 tensor of `values` (at::tensor of a braced list of mixed literals is ambiguous).
inline at::Tensor int64s(const std::vector<int64_t>& values) { return at::tensor(values, at::kLong); }

// The largest difference, relative to the reference's largest magnitude.
inline double relative_error(const at::Tensor& actual, const at::Tensor& expected) {
  const double scale = expected.abs().max().item<double>();
  return (actual - expected).abs().max().item<double>() / std::max(scale, 1e-30);
}

// How far a fused kernel's result may be from float64 on the same rounded inputs, relative to
// the largest value: twice the result's one rounding to bf16 or fp16 (unit roundoff 2^-8 and
// 2^-11); 64 float32 roundings for float32 results and float32 math.
inline double kernel_bound(at::ScalarType dtype) {
  if (dtype == at::kBFloat16) return std::ldexp(1.0, -7);
  if (dtype == at::kHalf) return std::ldexp(1.0, -10);
  return 64 * std::numeric_limits<float>::epsilon();
}

// `model` (built from `config`) again in float64 on the same device, holding its weights.
inline std::shared_ptr<fsdpp::CausalLM> float64_twin(const fsdpp::ModelConfig& config, fsdpp::CausalLM& model) {
  const auto params = fsdpp::unique_named_parameters(model);
  auto twin = fsdpp::build_model(config, at::TensorOptions(at::kDouble).device(params.front().tensor.device()));
  std::map<std::string, at::Tensor> weights;
  for (const auto& p : params) weights[p.name] = p.tensor;
  at::NoGradGuard no_grad;
  for (const auto& p : fsdpp::unique_named_parameters(*twin)) p.tensor.copy_(weights.at(p.name));
  return twin;
}

// Whether backward from `output` runs a node whose name holds `name` ("FlashAttentionBackward0",
// or a custom function's class name).
inline bool backward_runs(const at::Tensor& output, const std::string& name) {
  std::vector<torch::autograd::Node*> pending{output.grad_fn().get()};
  std::unordered_set<torch::autograd::Node*> seen;
  while (!pending.empty()) {
    auto* node = pending.back();
    pending.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    if (node->name().find(name) != std::string::npos) return true;
    for (const auto& edge : node->next_edges()) pending.push_back(edge.function.get());
  }
  return false;
}

// Whether the GPU half of a [gpu] test runs: where the test sees a GPU. Under
// FSDPP_REQUIRE_GPU_TESTS=1 (scripts/gpu_check.sh units) seeing none fails the test.
inline bool gpu_half_runs() {
  if (at::hasCUDA()) return true;
  const char* required = std::getenv("FSDPP_REQUIRE_GPU_TESTS");
  if (required != nullptr && std::string(required) == "1") FAIL("FSDPP_REQUIRE_GPU_TESTS=1, but no GPU is visible");
  return false;
}
