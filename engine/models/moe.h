// Mixture-of-experts layers: a router that sends each token to K of E experts, the experts
// computed over tokens grouped by expert, and the record of what was routed, which the
// trainer reads for the load-balancing loss, the expert-load metrics and the routing bias.
#pragma once

#include "models/decoder.h"

#include <vector>

namespace fsdpp {

// What one MoE layer routed in the model's last forward.
struct LayerRouting {
  at::Tensor selected;          // [N, K] int64: the experts each token went to, best first
  at::Tensor counts;            // [E] int64 on the layer's device: tokens each expert received
  at::Tensor probability_sum;   // [E] the router's probabilities (float32, float64 for a float64
                                // model) summed over tokens, with grad
};

// One record per MoE layer, in layer order. A layer overwrites its own record at each forward,
// so a recomputation in backward (activation checkpointing) leaves it as the forward left it.
struct RoutingLog {
  std::vector<LayerRouting> layers;
  // [E] d(loss) / d(probability_sum), the same for every layer: what backward adds to the
  // router probabilities of each MoE layer, filled in place between forward and backward by
  // add_load_balancing_loss (zero until then). Backward reaches it through each layer's
  // output, so the gradient also flows where activation checkpointing recomputes a layer.
  at::Tensor probability_gradient;
};

// The routed experts of one layer, children "0" .. "E-1" as transformers names them. A module
// of its own so that a policy can give the experts a unit of their own.
class Experts : public Module {
 public:
  Experts(const DecoderFamily& family, const ModelConfig& config, const torch::TensorOptions& opts);
  FSDPP_MODULE_CALL
  // tokens [M, C] grouped by expert, counts[e] rows for expert e in turn (counts [E] int64 on
  // the tokens' device) -> [M, C]. Every expert runs, on no rows where it got none: its
  // gradient is then zero rather than absent, so every rank reduces the same tensors.
  torch::Tensor forward(const torch::Tensor& tokens, const at::Tensor& counts);
  bool routed_experts() const override { return true; }

 private:
  // Whether one grouped product (ATen's _grouped_mm: a grouped GEMM kernel for bf16 on
  // recent GPUs, a loop of matrix products on the CPU) can compute every expert: bf16 rows on
  // a GPU, float32, bf16 or fp16 rows on the CPU, whose strides are multiples of 16 bytes, and
  // experts that are plain MLPs called without hooks (no adapter, no bias, no unit of their own).
  bool takes_grouped_product(const torch::Tensor& tokens) const;
  torch::Tensor grouped_forward(const torch::Tensor& tokens, const at::Tensor& counts);
  torch::Tensor expert_by_expert(const torch::Tensor& tokens, const at::Tensor& counts);

  std::vector<std::shared_ptr<MLP>> experts_;
};

// DeepSeek-V3's router: sigmoid scores of the tokens for every expert, and the per-expert
// bias that only steers the choice (e_score_correction_bias: a parameter no optimizer
// touches, which training may move by the auxiliary-loss-free update).
class GroupedTopkRouter : public Module {
 public:
  GroupedTopkRouter(const DecoderFamily& family, const ModelConfig& config, const torch::TensorOptions& opts);
  FSDPP_MODULE_CALL
  // [N, C] -> [2, N, E]: the scores in (0, 1), then the scores plus the bias (no gradient)
  // that choose the experts. Both come from one call, so that nothing reads the bias after
  // the call, when a unit of the router's own may have freed its gathered parameters.
  torch::Tensor forward(const torch::Tensor& x);
  void init_parameter(const std::string& name, torch::Tensor& t, at::Generator& gen, double std) override;
  bool updated_without_gradient(const std::string& name) const override { return name == "e_score_correction_bias"; }
  bool keeps_float32() const override { return true; }

  torch::Tensor weight;                   // [E, C]
  torch::Tensor e_score_correction_bias;  // [E]
};

// A MoE layer's feed-forward part: each token's K routed experts, weighted, plus the shared
// experts where the model has them. Qwen3-MoE ("SparseMoeBlock"): softmax over a linear gate,
// the top K, optionally renormalised. DeepSeek-V3 ("MoE"): sigmoid scores plus the correction
// bias pick the best topk_group groups of experts and the top K inside them; the K scores,
// optionally renormalised, are scaled by routed_scaling_factor.
class MoeBlock : public FeedForward {
 public:
  MoeBlock(const DecoderFamily& family, const ModelConfig& config, const torch::TensorOptions& opts,
           std::shared_ptr<RoutingLog> log, size_t log_index);
  torch::Tensor forward(const torch::Tensor& x) override;  // [B, T, C] -> [B, T, C]
  // The module that routes tokens (transformers' "gate"), whichever kind this model's is.
  const Module* routing_module() const;

 private:
  struct Choice {
    at::Tensor probabilities;  // [N, E] what the router gives each expert (float32 at least)
    at::Tensor selected;       // [N, K] int64
    at::Tensor weights;        // [N, K] each chosen expert's weight
  };
  Choice route(const torch::Tensor& flat);  // flat [N, C]

  MoeConfig config_;
  std::shared_ptr<Linear> gate_;               // softmax routing
  std::shared_ptr<GroupedTopkRouter> router_;  // grouped sigmoid routing, also named "gate"
  std::shared_ptr<Experts> experts_;
  std::shared_ptr<MLP> shared_experts_;        // DeepSeek-V3; null without
  std::shared_ptr<RoutingLog> log_;
  size_t log_index_;
};

// Adds Qwen3-MoE's load-balancing loss, weighted by `weight`, to the coming backward, as
// transformers computes it over every MoE layer's router outputs taken together:
// E × Σ_e f_e P_e, f_e the share of routed slots expert e received and P_e its mean router
// probability. The counts behind f are global (`global_counts` [E], summed over layers and
// ranks, of `global_rows` router rows); the probabilities are this rank's. The loss is linear
// in them, so the ranks' shares sum to the loss of the whole batch, and so do their
// gradients. Returns this rank's share of the weighted loss (0-dim, no grad).
at::Tensor add_load_balancing_loss(RoutingLog& log, const at::Tensor& global_counts, const at::Tensor& global_rows,
                                   double weight);

}  // namespace fsdpp
