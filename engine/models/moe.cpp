// Routing and grouped expert compute. Tokens are sorted by the expert they go to, so each
// expert runs one matrix product over a contiguous block of rows rather than a loop over
// tokens, and where the dtype and layout allow, all experts run in one grouped product; the
// outputs return to their tokens by one scatter-add.
#include "models/elementwise.h"
#include "models/moe.h"

#include <ATen/ATen.h>

#include <limits>
#include <torch/csrc/autograd/custom_function.h>

namespace fsdpp {

namespace {

// The grouped product's layout: every row stride a multiple of 16 bytes, and each expert's
// group of rows a whole number of 16-row blocks, at least one (the weight gradient's product
// runs along the rows, whose group boundaries its kernels need 16-byte aligned, and no group
// is left empty).
constexpr int64_t kGroupedAlignmentBytes = 16;
constexpr int64_t kGroupedAlignmentRows = 16;

// The experts' weights, each [out, in], as one [E, out, in] tensor for a grouped product.
// Where they lie one stride apart, as a unit's gathered buffer lays out the experts of a
// layer, it views them where they are: a view that owns nothing, so it serves only while
// `weights` hold their memory, for the one product it is made for. Elsewhere (experts gathered
// by units of their own, a model without FSDP) they are stacked into a copy.
at::Tensor expert_weights(at::TensorList weights) {
  const at::Tensor& first = weights[0];
  const auto address = [](const at::Tensor& w) { return reinterpret_cast<std::intptr_t>(w.data_ptr()); };
  const std::intptr_t step = weights.size() > 1 ? address(weights[1]) - address(first) : 0;
  bool in_place = step >= 0 && step % kGroupedAlignmentBytes == 0 && address(first) % kGroupedAlignmentBytes == 0;
  for (size_t e = 0; e < weights.size() && in_place; ++e) {
    const at::Tensor& w = weights[e];
    in_place = w.is_contiguous() && w.sizes() == first.sizes() && w.scalar_type() == first.scalar_type() &&
               w.device() == first.device() && address(w) == address(first) + static_cast<std::intptr_t>(e) * step;
  }
  if (!in_place) return at::stack(weights);
  const int64_t stride = step / static_cast<std::intptr_t>(first.element_size());
  return at::for_blob(first.data_ptr(), {static_cast<int64_t>(weights.size()), first.size(0), first.size(1)})
      .strides({stride, first.size(1), 1})
      .options(first.options())
      .target_device(first.device())
      .make_tensor();
}

// One projection of every expert at once: x [P, in] in groups ending at `offsets` [E], group e
// times weights[e] [out, in] transposed -> [P, out]. Backward reads the weights again from the
// experts' own tensors, which FSDP frees after forward and gathers again for backward as it
// does any layer's weights (a stack kept for backward would hold every expert unsharded in
// between).
struct GroupedProjection : public torch::autograd::Function<GroupedProjection> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& offsets,
                            at::TensorList weights) {
    std::vector<at::Tensor> saved{x, offsets};
    saved.insert(saved.end(), weights.begin(), weights.end());
    ctx->save_for_backward(saved);
    return at::_grouped_mm(x, expert_weights(weights).transpose(1, 2), offsets);  // [P, out]
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& offsets = saved[1];
    const std::vector<at::Tensor> weights(saved.begin() + 2, saved.end());
    const auto grad = grads[0].contiguous();  // [P, out]
    torch::autograd::variable_list result(2 + weights.size());
    if (ctx->needs_input_grad(0)) result[0] = at::_grouped_mm(grad, expert_weights(weights), offsets);  // [P, in]
    // Frozen experts (a LoRA run's base) need no weight gradients: the product is skipped
    // when no expert needs one.
    bool any_weight = false;
    for (size_t e = 0; e < weights.size(); ++e) any_weight = any_weight || ctx->needs_input_grad(2 + e);
    if (any_weight) {
      const auto per_expert = at::_grouped_mm(grad.t(), x, offsets).unbind(0);  // E x [out, in]
      for (size_t e = 0; e < weights.size(); ++e) {
        if (ctx->needs_input_grad(2 + e)) result[2 + e] = per_expert[e];
      }
    }
    return result;
  }
};

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

torch::Tensor Experts::forward(const torch::Tensor& tokens, const at::Tensor& counts) {
  return takes_grouped_product(tokens) ? grouped_forward(tokens, counts) : expert_by_expert(tokens, counts);
}

bool Experts::takes_grouped_product(const torch::Tensor& tokens) const {
  const auto dtype = tokens.scalar_type();
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) return false;
  // Hopper and newer GPUs have a grouped GEMM kernel for bf16 alone: for other dtypes ATen
  // loops over the groups after reading their offsets back to the host, a sync at every
  // product, where one product per expert needs none (the counts are on the host already).
  // Older GPUs take that loop in bf16 too; the GPUs this engine targets are Hopper's.
  if (tokens.is_cuda() && dtype != at::kBFloat16) return false;
  const auto aligned = [&](int64_t elements) { return elements * tokens.element_size() % kGroupedAlignmentBytes == 0; };
  for (const auto& expert : experts_) {
    if (!expert->calls_forward_alone()) return false;
    for (const Linear* projection : {&expert->gate_proj(), &expert->up_proj(), &expert->down_proj()}) {
      if (!projection->calls_forward_alone() || projection->has_adapter() || projection->bias.defined() ||
          projection->weight.scalar_type() != dtype || !aligned(projection->weight.size(1))) {
        return false;
      }
    }
  }
  return aligned(tokens.size(1));
}

torch::Tensor Experts::grouped_forward(const torch::Tensor& tokens, const at::Tensor& counts) {
  // Each expert's group is a whole number of kGroupedAlignmentRows blocks, at least one; the
  // rows after its tokens are zeros, whose products are discarded and add nothing to the
  // weights' gradients (an idle expert's gradient is exactly zero). The layout is computed
  // where the counts are, so that a GPU never waits for the host here.
  const auto E = static_cast<int64_t>(experts_.size());
  const int64_t M = tokens.size(0);
  const auto blocks = at::div(counts + (kGroupedAlignmentRows - 1), kGroupedAlignmentRows, "floor").clamp_min(1) *
                      kGroupedAlignmentRows;  // [E] padded group sizes
  const auto ends = blocks.cumsum(0);          // [E]
  const auto pad = blocks - counts;            // [E] zero rows after each expert's tokens
  const auto shift = pad.cumsum(0) - pad;      // [E] padded start - packed start: the padding before
  // The row count must be known on the host to allocate. A GPU takes the bound that no
  // routing can exceed (each group pads by fewer than one block, an idle one by a whole
  // block) rather than read the counts back, a wait for all the work queued before; the
  // last group takes the slack. The host reads its exact count for free.
  const int64_t padded = tokens.is_cuda()
                             ? (M + kGroupedAlignmentRows - 1) / kGroupedAlignmentRows * kGroupedAlignmentRows +
                                   E * kGroupedAlignmentRows
                             : ends[E - 1].item<int64_t>();
  const auto offsets = ends.to(at::kInt);  // [E]
  offsets.select(0, E - 1).fill_(padded);
  const auto rows = at::arange(M, counts.options()) + at::repeat_interleave(shift, counts, 0, M);     // [M]
  const auto grouped = at::zeros({padded, tokens.size(1)}, tokens.options()).index_copy(0, rows, tokens);  // [P, C]

  std::vector<at::Tensor> gate, up, down;
  for (const auto& expert : experts_) {
    gate.push_back(expert->gate_proj().weight);
    up.push_back(expert->up_proj().weight);
    down.push_back(expert->down_proj().weight);
  }
  const auto project = [&](const at::Tensor& x, const std::vector<at::Tensor>& weights) {
    return GroupedProjection::apply(x, offsets, at::TensorList(weights));
  };
  const auto inner = swiglu(project(grouped, gate), project(grouped, up));  // [P, I]
  return project(inner, down).index_select(0, rows);                           // [M, C]
}

torch::Tensor Experts::expert_by_expert(const torch::Tensor& tokens, const at::Tensor& counts) {
  // One product per expert needs each expert's row count on the host: a wait for the device.
  const auto host_counts = counts.cpu();
  const auto* count = host_counts.const_data_ptr<int64_t>();
  std::vector<at::Tensor> outputs;
  outputs.reserve(experts_.size());
  int64_t first = 0;
  for (size_t e = 0; e < experts_.size(); ++e) {
    outputs.push_back((*experts_[e])(tokens.narrow(0, first, count[e])));  // [count[e], C]
    first += count[e];
  }
  return at::cat(outputs);  // [M, C]
}

GroupedTopkRouter::GroupedTopkRouter(const DecoderFamily& family, const ModelConfig& c, const torch::TensorOptions& opts)
    : Module(family.prefix + "TopkRouter") {
  weight = register_parameter("weight", new_parameter({c.moe->num_experts, c.hidden_size}, opts));
  // Steers the choice only: no gradient reaches it, and the optimizer leaves it alone.
  e_score_correction_bias = register_parameter("e_score_correction_bias",
                                               new_parameter({c.moe->num_experts}, opts), /*requires_grad=*/false);
}

torch::Tensor GroupedTopkRouter::forward(const torch::Tensor& x) {
  // In float32 as transformers scores, or float64 for a float64 model.
  const auto dtype = at::promote_types(x.scalar_type(), at::kFloat);
  const auto scores = at::linear(x.to(dtype), weight.to(dtype)).sigmoid();  // [N, E]
  return at::stack({scores, scores.detach() + e_score_correction_bias.to(dtype)});  // [2, N, E]
}

void GroupedTopkRouter::init_parameter(const std::string& name, torch::Tensor& t, at::Generator& gen, double std) {
  if (name == "weight") {
    fill_normal(t, gen, std);
  } else {
    t.zero_();
  }
}

MoeBlock::MoeBlock(const DecoderFamily& family, const ModelConfig& c, const torch::TensorOptions& opts,
                   std::shared_ptr<RoutingLog> log, size_t log_index)
    : FeedForward(family.prefix + (c.moe->routing == MoeConfig::Routing::grouped_sigmoid ? "MoE" : "SparseMoeBlock")),
      config_(*c.moe),
      log_(std::move(log)),
      log_index_(log_index) {
  if (config_.routing == MoeConfig::Routing::grouped_sigmoid) {
    router_ = register_child("gate", std::make_shared<GroupedTopkRouter>(family, c, opts));
  } else {
    gate_ = register_child("gate", std::make_shared<Linear>(c.hidden_size, config_.num_experts, false, opts));
  }
  experts_ = register_child("experts", std::make_shared<Experts>(family, c, opts));
  if (config_.n_shared_experts > 0) {
    shared_experts_ = register_child(
        "shared_experts", std::make_shared<MLP>(family, c, config_.moe_intermediate_size * config_.n_shared_experts, opts));
  }
}

MoeBlock::Choice MoeBlock::route(const torch::Tensor& flat) {
  const int64_t K = config_.num_experts_per_tok;
  if (config_.routing == MoeConfig::Routing::softmax_top_k) {
    // In float32 as transformers routes, or float64 for a float64 model, whose runs are then
    // exact to float64 rounding like every other part.
    auto probabilities = at::softmax((*gate_)(flat), 1, at::promote_types(flat.scalar_type(), at::kFloat));  // [N, E]
    auto [weights, selected] = at::topk(probabilities, K, /*dim=*/1);  // [N, K] each, best first
    if (config_.norm_topk_prob) weights = weights / weights.sum(-1, /*keepdim=*/true);
    return {probabilities, selected, weights.to(flat.scalar_type())};
  }
  const auto scored = (*router_)(flat);  // [2, N, E]
  const auto scores = scored[0], biased = scored[1];  // [N, E] each
  at::Tensor selected;
  {
    // The choice: scores plus the bias, the best two of each group scoring the group; experts
    // outside the best groups score -inf, as transformers 5 masks them, so a biased score
    // below 0 in a best group still wins over every expert outside them.
    at::NoGradGuard no_grad;
    const int64_t N = scores.size(0), G = config_.n_group, E = config_.num_experts;
    const auto group_scores = std::get<0>(biased.view({N, G, E / G}).topk(2, -1)).sum(-1);  // [N, G]
    const auto best_groups = std::get<1>(group_scores.topk(config_.topk_group, -1));           // [N, topk_group]
    const auto in_best = at::zeros({N, G}, scores.options().dtype(at::kBool)).scatter(1, best_groups, true);
    const auto allowed = in_best.unsqueeze(-1).expand({N, G, E / G}).reshape({N, E});
    selected = std::get<1>(biased.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity()).topk(K, -1));    // [N, K]
  }
  auto weights = scores.gather(1, selected);  // [N, K]
  if (config_.norm_topk_prob) weights = weights / (weights.sum(-1, /*keepdim=*/true) + 1e-20);
  return {scores, selected, weights * config_.routed_scaling_factor};
}

const Module* MoeBlock::routing_module() const {
  return gate_ ? static_cast<const Module*>(gate_.get()) : router_.get();
}

torch::Tensor MoeBlock::forward(const torch::Tensor& x) {
  const int64_t C = x.size(-1);
  const auto flat = x.reshape({-1, C});  // [N, C]
  const Choice choice = route(flat);
  const int64_t K = config_.num_experts_per_tok, E = config_.num_experts;

  // Slot s = token × K + k; sorted by expert, stably, so each expert's tokens keep their order.
  const auto expert_of_slot = choice.selected.reshape({-1});                 // [N K]
  const auto order = at::argsort(expert_of_slot, /*stable=*/true);          // [N K]
  const auto token_of = at::div(order, K, "floor");                         // [N K]
  // Counted on the device by a scatter: at::bincount reads the largest index back first.
  const auto counts =
      at::zeros({E}, expert_of_slot.options()).scatter_add_(0, expert_of_slot, at::ones_like(expert_of_slot));  // [E]
  auto routed = (*experts_)(flat.index_select(0, token_of), counts);        // [N K, C]
  // Summed in the weights' dtype (DeepSeek-V3's are float32 whatever the model's), as
  // transformers sums them.
  routed = routed * choice.weights.reshape({-1}).index_select(0, order).unsqueeze(1);
  auto out = at::zeros({flat.size(0), C}, routed.options()).index_add(0, token_of, routed).to(x.scalar_type());  // [N, C]
  if (shared_experts_) out = out + (*shared_experts_)(flat);

  auto& record = log_->layers[log_index_];
  record = {.selected = choice.selected, .counts = counts, .probability_sum = choice.probabilities.sum(0)};
  auto& gradient = log_->probability_gradient;
  if (!gradient.defined() || gradient.device() != x.device() || gradient.scalar_type() != choice.probabilities.scalar_type()) {
    gradient = at::zeros({E}, choice.probabilities.options());
  }
  if (at::GradMode::is_enabled()) out = LoadBalancingGradient::apply(out, record.probability_sum, gradient);
  return out.view(x.sizes());
}

at::Tensor add_load_balancing_loss(RoutingLog& log, const at::Tensor& global_counts, const at::Tensor& global_rows,
                                   double weight) {
  const at::Tensor& gradient = log.probability_gradient;  // [E]
  const auto E = static_cast<double>(gradient.size(0));
  at::NoGradGuard no_grad;
  const auto factor = ((weight * E) / (global_rows * global_rows)).to(gradient.options());  // [1]
  gradient.copy_(global_counts.to(gradient.options()) * factor);
  at::Tensor share = at::zeros({}, gradient.options());
  for (const auto& layer : log.layers) share += (gradient * layer.probability_sum).sum();
  return share;
}

}  // namespace fsdpp
