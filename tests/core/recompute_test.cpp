// Activation recomputation: a checkpointed module runs its forward again in backward (its
// children are called twice per step) and yields exactly the gradients of a plain run.
#include "core/module_tree.h"
#include "data/evaluate.h"
#include "loss/next_token_loss.h"
#include "models/registry.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

using namespace fsdpp;

TEST_CASE("checkpointed layers recompute in backward and give the same gradients", "[core]") {
  auto config = ModelConfig::from_json(
      {{"model_type", "qwen2"}, {"vocab_size", 23}, {"hidden_size", 16}, {"intermediate_size", 24},
       {"num_hidden_layers", 2}, {"num_attention_heads", 2}, {"num_key_value_heads", 1}},
      "test");
  auto make = [&] {
    auto m = build_model(config, torch::TensorOptions());
    init_parameters(*m, 3, 0.2);
    return m;
  };
  auto plain = make();
  auto checkpointed = make();
  for (auto* model : {plain.get(), checkpointed.get()}) {
    for (const auto& e : named_modules(*model)) {
      if (e.module->class_name() == "Qwen2DecoderLayer") e.module->set_activation_checkpointing(model == checkpointed.get());
    }
  }
  int mlp_calls = 0;
  find_module(*checkpointed, "model.layers.1.mlp")->add_pre_forward_hook([&](Module&, Module::Tensors&) { ++mlp_calls; });
  auto ids = torch::randint(0, 23, {2, 7}, torch::kLong);
  for (auto* model : {plain.get(), checkpointed.get()}) {
    next_token_loss_sum((*model)(ids.narrow(1, 0, 6)), ids.narrow(1, 1, 6)).backward();
  }
  CHECK(mlp_calls == 2);  // once in forward, once recomputed in backward
  auto a = unique_named_parameters(*plain);
  auto b = unique_named_parameters(*checkpointed);
  for (size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].name);
    CHECK(torch::equal(a[i].tensor.grad(), b[i].tensor.grad()));
  }
  // Without grad there is nothing to recompute.
  mlp_calls = 0;
  {
    torch::NoGradGuard no_grad;
    (*checkpointed)(ids);
  }
  CHECK(mlp_calls == 1);
}
