// Checks the model tests share: how far a tensor is from a reference, and which autograd node
// a backward runs (how a test knows which kernel the engine chose where both give the same
// numbers).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <string>
#include <unordered_set>
#include <vector>

// The largest difference, relative to the reference's largest magnitude.
inline double relative_error(const at::Tensor& actual, const at::Tensor& expected) {
  const double scale = expected.abs().max().item<double>();
  return (actual - expected).abs().max().item<double>() / std::max(scale, 1e-30);
}

// Whether backward from `output` runs a node named `name` ("GroupedMmBackward0").
inline bool backward_runs(const at::Tensor& output, const std::string& name) {
  std::vector<torch::autograd::Node*> pending{output.grad_fn().get()};
  std::unordered_set<torch::autograd::Node*> seen;
  while (!pending.empty()) {
    auto* node = pending.back();
    pending.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    if (node->name() == name) return true;
    for (const auto& edge : node->next_edges()) pending.push_back(edge.function.get());
  }
  return false;
}
