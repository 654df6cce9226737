// Activation recomputation (activation checkpointing): run a forward without keeping its
// activations and recompute it in backward. LibTorch's C++ API has none; this is one
// autograd node whose backward re-runs the body with grad enabled and backpropagates
// through the recomputed graph.
// The body must be deterministic (the models here have no dropout).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace fsdpp {

using RecomputeBody = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

// body(inputs) whose backward recomputes body; parameters used inside receive their
// gradients during that recomputation.
at::Tensor recomputed_in_backward(const std::vector<at::Tensor>& inputs, RecomputeBody body);

}  // namespace fsdpp
