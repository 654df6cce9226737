// Mixture-of-experts layers: a router that sends each token to K of E experts, the experts
// computed over tokens grouped by expert, and the record of what was routed, which the
// trainer reads for the load-balancing loss and the expert-load metrics.
#pragma once

#include "models/layers.h"

#include <vector>

namespace fsdpp {

class MLP;
struct DecoderFamily;

// What one MoE layer routed in the model's last forward.
struct LayerRouting {
  at::Tensor selected;          // [N, K] int64: the experts each token went to, best first
  at::Tensor counts;            // [E] int64 on the host: tokens each expert received
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
  // tokens [M, C] grouped by expert, counts[e] rows for expert e in turn -> [M, C]. Every
  // expert runs, on no rows where it got none: its gradient is then zero rather than absent,
  // so every rank reduces the same tensors.
  torch::Tensor forward(const torch::Tensor& tokens, const std::vector<int64_t>& counts);
  bool routed_experts() const override { return true; }

 private:
  std::vector<std::shared_ptr<MLP>> experts_;
};

// Qwen3-MoE's sparse block: softmax routing to the top K experts, weights optionally
// renormalised over the K, outputs summed by weight.
class SparseMoeBlock : public Module {
 public:
  SparseMoeBlock(const DecoderFamily& family, const ModelConfig& config, const torch::TensorOptions& opts,
                 std::shared_ptr<RoutingLog> log, size_t log_index);
  FSDPP_MODULE_CALL
  torch::Tensor forward(const torch::Tensor& x);  // [B, T, C] -> [B, T, C]

 private:
  int64_t top_k_;
  bool norm_topk_prob_;
  std::shared_ptr<Linear> gate_;
  std::shared_ptr<Experts> experts_;
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
at::Tensor add_load_balancing_loss(RoutingLog& log, const at::Tensor& global_counts, double global_rows,
                                   double weight);

}  // namespace fsdpp
