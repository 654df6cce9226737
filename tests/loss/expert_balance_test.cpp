// Load balancing from the step's routing: DeepSeek-V3's routing biases move by the rate toward
// balance, each expert by the sign of its layer's mean minus its own count over the whole
// step; the expert-load figure is the busiest expert over its layer's mean; Qwen3-MoE's
// logged load-balancing loss is the one the step's micro-batches added to their loss. Counts
// are taken here from the experts each token went to, not from the engine's own tallies.
#include "core/module_tree.h"
#include "distributed/comm.h"
#include "fsdp/fsdp_state.h"
#include "loss/expert_balance.h"
#include "models/moe.h"
#include "models/registry.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>

using namespace fsdpp;

namespace {

constexpr int64_t kExperts = 8;
constexpr int64_t kMicroBatches = 2;

// The experts of one micro-batch's MoE layers, counted from the experts each token went to.
std::vector<at::Tensor> counted(const RoutingLog& log) {
  std::vector<at::Tensor> counts;  // [E] float64 per layer
  for (const auto& layer : log.layers) {
    counts.push_back(at::bincount(layer.selected.flatten().cpu(), {}, kExperts).to(at::kDouble));
  }
  return counts;
}

// The parameters `names` as the optimizer holds them (the view's rows: one rank owns them whole).
std::map<std::string, at::Tensor> parameters_named(const ShardedView& view, const std::vector<std::string>& names) {
  std::map<std::string, at::Tensor> found;
  for (const auto& r : view.shard_rows()) {
    if (std::find(names.begin(), names.end(), r.name) != names.end()) found[r.name] = r.rows.detach().clone();
  }
  return found;
}

struct StepRouting {
  at::Tensor counts;    // [L, E] over the step's micro-batches
  at::Tensor last;      // [L, E] of its last micro-batch
  double shares = 0.0;  // the sum of the loss shares micro_batch_loss returned
};

// Runs kMicroBatches forwards, each added to `balance`.
StepRouting run_step(CausalLM& model, ExpertBalance& balance, Comm& comm, int64_t vocab) {
  StepRouting step;
  for (int64_t m = 0; m < kMicroBatches; ++m) {
    const auto ids = at::randint(0, vocab, {2, 12}, at::kLong);  // [B, T]
    const auto logits = model(ids);                               // [B, T, V]
    step.last = at::stack(counted(*model.routing()));
    step.counts = step.counts.defined() ? step.counts + step.last : step.last;
    step.shares += balance.micro_batch_loss(*model.routing(), comm, kMicroBatches).item<double>();
  }
  return step;
}

}  // namespace

TEST_CASE("routing biases move toward balance by the rate, from the whole step's counts", "[train]") {
  const auto config = ModelConfig::from_json(
      {{"model_type", "deepseek_v3"}, {"vocab_size", 40}, {"hidden_size", 16}, {"intermediate_size", 24},
       {"num_hidden_layers", 3}, {"num_attention_heads", 2}, {"num_key_value_heads", 2}, {"q_lora_rank", nullptr},
       {"kv_lora_rank", 8}, {"qk_nope_head_dim", 4}, {"qk_rope_head_dim", 4}, {"v_head_dim", 4},
       {"n_routed_experts", kExperts}, {"n_group", 2}, {"topk_group", 1}, {"num_experts_per_tok", 2},
       {"n_shared_experts", 1}, {"moe_intermediate_size", 8}, {"first_k_dense_replace", 1},
       {"routed_scaling_factor", 2.5}, {"norm_topk_prob", true}},
      "expert_balance_test");
  auto model = build_model(config, torch::TensorOptions().dtype(at::kDouble));
  init_parameters(*model, /*seed=*/5, /*std=*/0.3);
  at::manual_seed(3);
  const auto names = routing_bias_names(*model);
  REQUIRE(names.size() == 2);  // layers 1 and 2; layer 0 is dense
  const double rate = 0.01;
  ExpertBalance balance(*config.moe, ExpertsConfig{.bias_update_rate = rate}, names);
  auto comm = Comm::single();
  {  // biases away from zero, so that an update setting them rather than moving them shows
    at::NoGradGuard no_grad;
    for (const auto& p : unique_named_parameters(*model)) {
      if (std::find(names.begin(), names.end(), p.name) != names.end()) p.tensor.copy_(at::randn_like(p.tensor) * 0.05);
    }
  }
  // The model as training holds it: one unit, one rank.
  FsdpState view(*model, comm, resolve_plan(Plan{.units = {{.modules = {""}}}}, *model, 1, at::kDouble));

  const auto before = parameters_named(view, names);
  const StepRouting step = run_step(*model, balance, *comm, 40);
  const at::Tensor& counts = step.counts;  // [L, E]
  balance.update_routing_bias(view);
  const auto after = parameters_named(view, names);
  bool last_alone_differs = false;
  for (size_t l = 0; l < names.size(); ++l) {
    INFO(names[l] << ": counts " << counts[l]);
    const auto mean = counts[l].mean();
    // A fair test needs experts on both sides of the mean.
    REQUIRE((counts[l] < mean).any().item<bool>());
    REQUIRE((counts[l] > mean).any().item<bool>());
    const auto up = (counts[l] < mean).to(at::kDouble), down = (counts[l] > mean).to(at::kDouble);  // [E]
    CHECK(at::equal(after.at(names[l]), before.at(names[l]) + (up - down) * rate));
    const auto last_side = (step.last[l].mean() - step.last[l]).sign();
    last_alone_differs = last_alone_differs || (last_side != up - down).any().item<bool>();
  }
  // Some expert sits on another side of the mean over the last micro-batch than over the
  // step: an update from that micro-batch alone would move it otherwise.
  REQUIRE(last_alone_differs);

  const ExpertLoad load = balance.finish_step();
  CHECK_FALSE(load.aux_loss.has_value());  // DeepSeek-V3 balances without an auxiliary loss
  CHECK(step.shares == 0.0);
  const double busiest = (std::get<0>(counts.max(1)) / counts.mean(1)).max().item<double>();
  CHECK(load.max_over_mean == Approx(busiest).epsilon(1e-12));
  CHECK(load.max_over_mean > 1.0);

  // The next step starts empty: without a micro-batch the biases stay where they are.
  balance.update_routing_bias(view);
  const auto unchanged = parameters_named(view, names);
  for (const auto& name : names) CHECK(at::equal(unchanged.at(name), after.at(name)));
}

TEST_CASE("the logged load-balancing loss is the one the step's micro-batches added", "[train]") {
  const double coefficient = 0.05;
  const auto config = ModelConfig::from_json(
      {{"model_type", "qwen3_moe"}, {"vocab_size", 40}, {"hidden_size", 16}, {"intermediate_size", 24},
       {"num_hidden_layers", 2}, {"num_attention_heads", 2}, {"num_key_value_heads", 1}, {"head_dim", 8},
       {"num_experts", kExperts}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 8},
       {"norm_topk_prob", false}, {"router_aux_loss_coef", coefficient}},
      "expert_balance_test");
  auto model = build_model(config, torch::TensorOptions().dtype(at::kDouble));
  init_parameters(*model, /*seed=*/9, /*std=*/0.3);
  at::manual_seed(4);
  ExpertBalance balance(*config.moe, ExpertsConfig{}, routing_bias_names(*model));
  auto comm = Comm::single();

  const StepRouting step = run_step(*model, balance, *comm, 40);
  const ExpertLoad load = balance.finish_step();
  REQUIRE(load.aux_loss.has_value());
  CHECK(*load.aux_loss > 0.0);
  CHECK(*load.aux_loss == Approx(step.shares / coefficient).epsilon(1e-12));
  const double busiest = (std::get<0>(step.counts.max(1)) / step.counts.mean(1)).max().item<double>();
  CHECK(load.max_over_mean == Approx(busiest).epsilon(1e-12));
}
