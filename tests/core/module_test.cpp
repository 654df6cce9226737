// The module base: hooks around forward, traversal by path, counts, tied parameters and
// name-seeded initialisation.
#include "core/module_tree.h"
#include "models/decoder.h"
#include "models/registry.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

using namespace fsdpp;

namespace {

std::shared_ptr<CausalLM> tiny(bool tied) {
  auto config = ModelConfig::from_json(
      {{"model_type", "qwen3"}, {"vocab_size", 11}, {"hidden_size", 12}, {"intermediate_size", 20},
       {"num_hidden_layers", 3}, {"num_attention_heads", 3}, {"num_key_value_heads", 1},
       {"head_dim", 6}, {"tie_word_embeddings", tied}},
      "test");
  auto model = build_model(config, torch::TensorOptions());
  init_parameters(*model, 1, 0.02);
  return model;
}

}  // namespace

TEST_CASE("named modules carry HF paths, class names and parents", "[core]") {
  auto model = tiny(false);
  auto modules = named_modules(*model);
  REQUIRE(modules.front().path.empty());
  CHECK(modules.front().module->class_name() == "Qwen3ForCausalLM");
  auto* layer = find_module(*model, "model.layers.2");
  REQUIRE(layer != nullptr);
  CHECK(layer->class_name() == "Qwen3DecoderLayer");
  CHECK(layer->parent()->class_name() == "ModuleList");
  CHECK(find_module(*model, "model.layers.1.self_attn.k_norm")->class_name() == "Qwen3RMSNorm");
  CHECK(find_module(*model, "model.layers.0.mlp.up_proj")->class_name() == "Linear");
  CHECK(find_module(*model, "model.embed_tokens")->class_name() == "Embedding");
  CHECK(find_module(*model, "model.layers.3") == nullptr);
  auto children = find_module(*model, "model.layers.0")->named_child_modules();
  REQUIRE(children.size() == 4);
  CHECK(children[0].first == "self_attn");
}

TEST_CASE("parameter counts: own, recursive, and tied weights counted once", "[core]") {
  auto untied = tiny(false);
  auto tied = tiny(true);
  auto* norm = find_module(*untied, "model.norm");
  CHECK(norm->own_param_count() == 12);
  CHECK(find_module(*untied, "model.layers.0")->own_param_count() == 0);
  // Tying removes exactly lm_head's 11 x 12 matrix.
  CHECK(untied->recursive_param_count() - tied->recursive_param_count() == 11 * 12);
  auto names = unique_named_parameters(*tied);
  CHECK(std::none_of(names.begin(), names.end(), [](auto& p) { return p.name == "lm_head.weight"; }));
  auto groups = tied_parameter_groups(*tied);
  REQUIRE(groups.size() == 1);
  CHECK(groups[0] == std::vector<std::string>{"model.embed_tokens.weight", "lm_head.weight"});
  CHECK(tied_parameter_groups(*untied).empty());
}

TEST_CASE("pre-forward hooks can replace inputs and post-forward hooks outputs", "[core]") {
  auto model = tiny(false);
  auto* mlp = find_module(*model, "model.layers.1.mlp");
  std::vector<std::string> order;
  int pre = mlp->add_pre_forward_hook([&](Module& m, Module::Tensors& in) {
    order.push_back("pre:" + m.class_name());
    REQUIRE(in.size() == 1);
    in[0] = torch::zeros_like(in[0]);
  });
  int post = mlp->add_post_forward_hook([&](Module& m, torch::Tensor& out) {
    order.push_back("post");
    out = out + 1.0;
  });
  auto ids = torch::tensor({{1, 2, 3}}, torch::kLong);
  auto x = torch::randn({1, 3, 12});
  // An MLP of zeros (no biases) gives zeros; the post hook adds one.
  auto& mlp_call = dynamic_cast<MLP&>(*mlp);
  auto y = mlp_call(x);
  CHECK(torch::allclose(y, torch::ones({1, 3, 12})));
  CHECK(order == std::vector<std::string>{"pre:Qwen3MLP", "post"});
  mlp->remove_hook(pre);
  mlp->remove_hook(post);
  auto y2 = mlp_call(x);
  CHECK_FALSE(torch::allclose(y2, torch::ones({1, 3, 12})));
  // Hooks also fire when the parent calls the child during a whole-model forward.
  int calls = 0;
  mlp->add_pre_forward_hook([&](Module&, Module::Tensors&) { ++calls; });
  (*model)(ids);
  CHECK(calls == 1);
}

TEST_CASE("initialisation depends on the seed and the parameter name only", "[core]") {
  auto a = tiny(false);
  auto b = tiny(false);
  auto pa = unique_named_parameters(*a);
  auto pb = unique_named_parameters(*b);
  REQUIRE(pa.size() == pb.size());
  for (size_t i = 0; i < pa.size(); ++i) CHECK(torch::equal(pa[i].tensor, pb[i].tensor));
  // Different layers draw different values; norms start at one.
  auto q0 = find_module(*a, "model.layers.0.self_attn.q_proj")->named_parameters()["weight"];
  auto q1 = find_module(*a, "model.layers.1.self_attn.q_proj")->named_parameters()["weight"];
  CHECK_FALSE(torch::equal(q0, q1));
  CHECK(q0.std().item<double>() == Approx(0.02).epsilon(0.2));
  CHECK(torch::equal(find_module(*a, "model.norm")->named_parameters()["weight"], torch::ones({12})));
}
