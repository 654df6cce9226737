// fully_shard in one process: a sharded model must compute the same loss and, in its owned
// shards, the same gradients as the plain model; sharded storage must be freed between
// uses; tied parameters split across units are refused.
#include "core/error.h"
#include "core/module_tree.h"
#include "fsdp/fsdp_state.h"
#include "models/registry.h"
#include "train/evaluate.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

using namespace fsdpp;

namespace {

std::shared_ptr<CausalLM> tiny(bool tied) {
  auto config = ModelConfig::from_json(
      {{"model_type", "llama"}, {"vocab_size", 40}, {"hidden_size", 30}, {"intermediate_size", 50},
       {"num_hidden_layers", 3}, {"num_attention_heads", 3}, {"num_key_value_heads", 1},
       {"tie_word_embeddings", tied}},
      "test");
  auto model = build_model(config, torch::TensorOptions());
  init_parameters(*model, 5, 0.1);
  return model;
}

double loss_of(CausalLM& model, const at::Tensor& ids) {
  auto loss = next_token_loss_sum(model(ids.narrow(1, 0, 8)), ids.narrow(1, 1, 8)) / 24.0;
  loss.backward();
  return loss.item<double>();
}

}  // namespace

TEST_CASE("a sharded model gives the plain model's loss and gradients", "[fsdp]") {
  const bool tied = GENERATE(false, true);
  INFO("tied " << tied);
  auto plain = tiny(tied);
  auto sharded = tiny(tied);
  auto state = shard_default(*sharded, DeviceMesh::create(Comm::single(), 1, -1));
  auto ids = torch::randint(0, 40, {3, 9}, torch::kLong);
  for (int step = 0; step < 2; ++step) {  // the second pass re-gathers what the first freed
    const double expected = loss_of(*plain, ids);
    CHECK(loss_of(*sharded, ids) == Approx(expected).epsilon(1e-6));
  }
  std::map<std::string, at::Tensor> plain_grads;
  for (const auto& p : unique_named_parameters(*plain)) plain_grads[p.name] = p.tensor.grad();
  for (const auto& p : state->sharded_parameters()) {
    INFO("gradient of " << p.name);
    REQUIRE(p.tensor.grad().defined());
    CHECK(torch::allclose(p.tensor.grad(), plain_grads.at(p.name), 1e-5, 1e-7));
  }
  for (const auto& unit : state->units()) {
    for (const auto& p : unit->params()) CHECK_FALSE(p.is_full());
  }
}

TEST_CASE("tied parameters split across units are refused naming both paths", "[fsdp]") {
  auto model = tiny(true);
  FsdpState state(*model, DeviceMesh::create(Comm::single(), 1, -1));
  CHECK_THROWS_WITH(state.fully_shard({find_module(*model, "model.embed_tokens")}, {}),
                    Catch::Contains("model.embed_tokens.weight") && Catch::Contains("lm_head.weight"));
}
