// Routing and grouped expert compute. Tokens are sorted by the expert they go to, so each
// expert runs one matrix product over a contiguous block of rows rather than a loop over
// tokens; the outputs return to their tokens by one scatter-add.
#include "models/moe.h"

#include "models/decoder.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

namespace fsdpp {

namespace {

// Identity on a MoE layer's output; its backward also hands the layer's router probability
// sum the load-balancing loss's gradient, read from the log's buffer only then, once the
// trainer has filled it. The buffer sits in saved_data, not among the saved tensors, because
// it is written in place after this forward, which a saved tensor's version check refuses.
struct LoadBalancingGradient : public torch::autograd::Function<LoadBalancingGradient> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& output,
                            const at::Tensor& probability_sum, const at::Tensor& gradient) {
    ctx->saved_data["gradient"] = gradient;
    return output;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], ctx->saved_data["gradient"].toTensor().clone(), at::Tensor()};
  }
};

}  // namespace

Experts::Experts(const DecoderFamily& family, const ModelConfig& c, const torch::TensorOptions& opts)
    : Module(family.prefix + "Experts") {
  for (int64_t e = 0; e < c.moe->num_experts; ++e) {
    experts_.push_back(register_child(std::to_string(e), std::make_shared<MLP>(family, c, c.moe->moe_intermediate_size, opts)));
  }
}

torch::Tensor Experts::forward(const torch::Tensor& tokens, const std::vector<int64_t>& counts) {
  std::vector<at::Tensor> outputs;
  outputs.reserve(experts_.size());
  int64_t first = 0;
  for (size_t e = 0; e < experts_.size(); ++e) {
    outputs.push_back((*experts_[e])(tokens.narrow(0, first, counts[e])));  // [counts[e], C]
    first += counts[e];
  }
  return at::cat(outputs);  // [M, C]
}

SparseMoeBlock::SparseMoeBlock(const DecoderFamily& family, const ModelConfig& c, const torch::TensorOptions& opts,
                               std::shared_ptr<RoutingLog> log, size_t log_index)
    : Module(family.prefix + "SparseMoeBlock"),
      top_k_(c.moe->num_experts_per_tok),
      norm_topk_prob_(c.moe->norm_topk_prob),
      log_(std::move(log)),
      log_index_(log_index) {
  gate_ = register_child("gate", std::make_shared<Linear>(c.hidden_size, c.moe->num_experts, false, opts));
  experts_ = register_child("experts", std::make_shared<Experts>(family, c, opts));
}

torch::Tensor SparseMoeBlock::forward(const torch::Tensor& x) {
  const int64_t C = x.size(-1);
  const auto flat = x.reshape({-1, C});                                    // [N, C]
  const auto logits = (*gate_)(flat);                                      // [N, E]
  // In float32 as transformers routes, or float64 for a float64 model, whose runs are then
  // exact to float64 rounding like every other part.
  const auto probabilities = at::softmax(logits, 1, at::promote_types(x.scalar_type(), at::kFloat));  // [N, E]
  auto [weights, selected] = at::topk(probabilities, top_k_, /*dim=*/1);   // [N, K] each, best first
  if (norm_topk_prob_) weights = weights / weights.sum(-1, /*keepdim=*/true);
  weights = weights.to(x.scalar_type());

  // Slot s = token × K + k; sorted by expert, stably, so each expert's tokens keep their order.
  const auto expert_of_slot = selected.reshape({-1});                            // [N K]
  const auto order = at::argsort(expert_of_slot, /*stable=*/true);              // [N K]
  const auto token_of = at::div(order, top_k_, "floor");                        // [N K]
  const int64_t E = gate_->weight.size(0);
  const auto counts = at::bincount(expert_of_slot, /*weights=*/{}, E);          // [E]
  // The split sizes are needed on the host; this is the one sync a forward makes here.
  const auto host_counts = counts.cpu();
  const std::vector<int64_t> split(host_counts.data_ptr<int64_t>(), host_counts.data_ptr<int64_t>() + E);
  auto routed = (*experts_)(flat.index_select(0, token_of), split);             // [N K, C]
  routed = routed * weights.reshape({-1}).index_select(0, order).unsqueeze(1);
  auto out = at::zeros_like(flat).index_add(0, token_of, routed);               // [N, C]

  auto& record = log_->layers[log_index_];
  record = {.selected = selected, .counts = host_counts, .probability_sum = probabilities.sum(0)};
  auto& gradient = log_->probability_gradient;
  if (!gradient.defined() || gradient.device() != x.device() || gradient.scalar_type() != probabilities.scalar_type()) {
    gradient = at::zeros({E}, probabilities.options());
  }
  if (at::GradMode::is_enabled()) out = LoadBalancingGradient::apply(out, record.probability_sum, gradient);
  return out.view(x.sizes());
}

at::Tensor add_load_balancing_loss(RoutingLog& log, const at::Tensor& global_counts, double global_rows,
                                   double weight) {
  const at::Tensor& gradient = log.probability_gradient;  // [E]
  const auto E = static_cast<double>(gradient.size(0));
  at::NoGradGuard no_grad;
  gradient.copy_(global_counts.to(gradient.device(), gradient.scalar_type()) * (weight * E / (global_rows * global_rows)));
  at::Tensor share = at::zeros({}, gradient.options());
  for (const auto& layer : log.layers) share += (gradient * layer.probability_sum).sum();
  return share;
}

}  // namespace fsdpp
