// The recompute-in-backward autograd node.
#include "core/recompute.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace fsdpp {

namespace {

struct RecomputeBackward : public torch::autograd::Node {
  RecomputeBody body;
  std::vector<at::Tensor> inputs;  // detached: only these survive forward
  std::vector<bool> needs_grad;

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::vector<at::Tensor> leaves;
    for (size_t i = 0; i < inputs.size(); ++i) {
      leaves.push_back(inputs[i].defined() ? inputs[i].detach().requires_grad_(needs_grad[i]) : inputs[i]);
    }
    at::Tensor output;
    {
      at::AutoGradMode grad_on(true);
      // The forward again as it ran, whatever autocast the caller's backward runs under.
      const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      output = body(leaves);
    }
    if (output.requires_grad()) torch::autograd::backward({output}, {grads[0]});
    torch::autograd::variable_list input_grads;
    for (size_t i = 0; i < leaves.size(); ++i) {
      if (needs_grad[i]) input_grads.push_back(leaves[i].grad());
    }
    return input_grads;
  }

  void release_variables() override { inputs.clear(); }
};

}  // namespace

at::Tensor recomputed_in_backward(const std::vector<at::Tensor>& inputs, RecomputeBody body) {
  at::Tensor output;
  {
    at::NoGradGuard no_grad;
    output = body(inputs);
  }
  if (!at::GradMode::is_enabled()) return output;
  auto node = std::make_shared<RecomputeBackward>();
  std::vector<at::Tensor> differentiable;
  for (const auto& x : inputs) {
    // An undefined input (an optional one left out) passes through as it is.
    const bool needs_grad = x.defined() && x.requires_grad();
    node->inputs.push_back(x.defined() ? x.detach() : x);
    node->needs_grad.push_back(needs_grad);
    if (needs_grad) differentiable.push_back(x);
  }
  node->body = std::move(body);
  node->set_next_edges(torch::autograd::collect_next_edges(differentiable));
  output = output.detach();
  torch::autograd::set_history(output, node);
  return output;
}

}  // namespace fsdpp
