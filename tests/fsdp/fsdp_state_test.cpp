// fully_shard in one process: a sharded model must compute the same loss and, in its owned
// shards, the same gradients as the plain model; sharded storage must be freed between
// uses; tied parameters split across units are refused; a unit waits for its host update; an
// offloaded gradient's norm is taken on the GPU as it leaves; on a GPU a forward and backward
// through bf16 units never wait for the device.
#include "core/error.h"
#include "core/module_tree.h"
#include "data/evaluate.h"
#include "fsdp/fsdp_state.h"
#include "loss/next_token_loss.h"
#include "models/fp8_product.h"
#include "models/layers.h"
#include "models/lora.h"
#include "models/registry.h"
#include "optim/adamw.h"
#include "device_waits.h"
#include "tensor_checks.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <future>
#include <thread>

using namespace fsdpp;

namespace {

// A Llama, or a Qwen3 (whose q and k norms keep the joint q, k, v product for backward).
std::shared_ptr<CausalLM> tiny(bool tied, const std::string& model_type = "llama") {
  auto config = ModelConfig::from_json(
      {{"model_type", model_type}, {"vocab_size", 40}, {"hidden_size", 30}, {"intermediate_size", 50},
       {"num_hidden_layers", 3}, {"num_attention_heads", 3}, {"num_key_value_heads", 1},
       {"tie_word_embeddings", tied}},
      "test");
  auto model = build_model(config, torch::TensorOptions());
  init_parameters(*model, 5, 0.1);
  return model;
}

// Each decoder layer a unit, the embedding too when untied, the root the rest; units gather
// and compute in `param_dtype` (none: the model's).
ResolvedPlan plan_for(CausalLM& model, std::optional<at::ScalarType> param_dtype) {
  Plan plan;
  for (const auto& e : named_modules(model)) {
    const bool tied = model.config().tie_word_embeddings;
    if (e.module->class_name().ends_with("DecoderLayer") || (e.module->class_name() == "Embedding" && !tied)) {
      plan.units.push_back({.modules = {e.path}, .param_dtype = param_dtype});
    }
  }
  plan.units.push_back({.modules = {""}, .reshard_after_forward = 1, .param_dtype = param_dtype});
  return resolve_plan(plan, model, 1, at::kFloat);
}

std::unique_ptr<FsdpState> shard(CausalLM& model, std::optional<at::ScalarType> param_dtype = std::nullopt) {
  return std::make_unique<FsdpState>(model, Comm::single(), plan_for(model, param_dtype));
}

// tiny(false) with rank-3 adapters on two projections and model.norm trainable, the rest
// frozen; lora_B drawn rather than zero, so every adapter factor gets a gradient.
std::shared_ptr<CausalLM> tiny_lora() {
  auto model = tiny(false);
  apply_lora(*model,
             {.targets = {"model.layers.0.self_attn.q_proj", "model.layers.2.mlp.down_proj"}, .rank = 3, .alpha = 6,
              .trainable = {"model.norm"}},
             torch::TensorOptions());
  init_parameters(*model, 5, 0.1);
  at::NoGradGuard no_grad;
  for (const auto& p : unique_named_parameters(*model)) {
    if (p.name.find(".lora_B.") != std::string::npos) {
      p.tensor.copy_(torch::randn(p.tensor.sizes(), named_generator(7, p.name)) * 0.1);
    }
  }
  return model;
}

// The loss of `model` on `ids` after its backward, and whether attention's q, k and v and the
// MLP's gate and up ran as joint products there (models/joint_projection.h).
std::pair<double, bool> loss_and_joint(CausalLM& model, const at::Tensor& ids) {
  auto loss = next_token_loss_sum(model(ids.narrow(1, 0, 8)), ids.narrow(1, 1, 8)) / 24.0;
  const bool joint = backward_runs(loss, "JointProjection") && backward_runs(loss, "JoinedSwiGLU");
  loss.backward();
  return {loss.item<double>(), joint};
}

double loss_of(CausalLM& model, const at::Tensor& ids) { return loss_and_joint(model, ids).first; }

}  // namespace

TEST_CASE("a sharded model gives the plain model's loss and gradients", "[fsdp]") {
  const bool tied = GENERATE(false, true);
  const std::string model_type = GENERATE("llama", "qwen3");
  INFO(model_type << ", tied " << tied);
  auto plain = tiny(tied, model_type);
  auto truth = float64_twin(plain->config(), *plain);
  auto sharded = tiny(tied, model_type);
  auto state = shard(*sharded);
  auto ids = torch::randint(0, 40, {3, 9}, torch::kLong);
  for (int step = 0; step < 2; ++step) {  // the second pass re-gathers what the first freed
    const auto [expected, plain_joint] = loss_and_joint(*plain, ids);
    const auto [loss, joint] = loss_and_joint(*sharded, ids);
    CHECK(loss == Approx(expected).epsilon(1e-6));
    // q, k and v, and gate and up, lie end to end in a unit of one rank; in the plain model
    // each has its own storage.
    CHECK(joint);
    CHECK_FALSE(plain_joint);
    loss_of(*truth, ids);
  }
  // Both round the same sums in float32, in other orders (the sharded model's joint
  // products): held to ten times the plain model's own distance from float64.
  std::map<std::string, at::Tensor> plain_grads, true_grads;
  for (const auto& p : unique_named_parameters(*plain)) plain_grads[p.name] = p.tensor.grad();
  for (const auto& p : unique_named_parameters(*truth)) true_grads[p.name] = p.tensor.grad();
  double noise = 0;
  for (const auto& [name, grad] : plain_grads) noise = std::max(noise, relative_error(grad, true_grads.at(name)));
  INFO("rounding noise " << noise);
  REQUIRE(noise < 1e-4);  // more is no rounding
  for (const auto& p : state->sharded_parameters()) {
    INFO("gradient of " << p.name);
    REQUIRE(p.tensor.grad().defined());
    CHECK(relative_error(p.tensor.grad(), plain_grads.at(p.name)) < 10 * noise);
  }
  for (const auto& unit : state->units()) {
    for (const auto& p : unit->params()) CHECK_FALSE(p.is_full());
  }
}

TEST_CASE("the unit expected next is gathered while the current one runs", "[fsdp]") {
  auto model = tiny(false);
  auto state = shard(*model);
  auto ids = torch::randint(0, 40, {3, 9}, torch::kLong);
  auto unit_of = [&](const std::string& name) {
    for (const auto& unit : state->units()) {
      if (unit->name() == name) return unit.get();
    }
    FAIL("no unit " << name);
    return static_cast<FsdpUnit*>(nullptr);
  };
  FsdpUnit* layer1 = unit_of("model.layers.1");
  FsdpUnit* layer2 = unit_of("model.layers.2");
  Module& layer1_module = *find_module(*model, "model.layers.1");
  Module& layer2_module = *find_module(*model, "model.layers.2");
  loss_of(*model, ids);  // the first pass records the order the units run in
  // Hooks added after FSDP's run after them: layer 1 is about to compute.
  bool forward_prefetched = false, backward_prefetched = false;
  layer1_module.add_pre_forward_hook([&](Module&, Module::Tensors&) {
    forward_prefetched = layer2->is_gathering() && !layer2->is_unsharded();
  });
  layer2_module.add_post_forward_hook([&](Module&, torch::Tensor& output) {
    // Runs after the FSDP hook on the same gradient, which gathered layer 2 for its backward.
    output.register_hook([&](const at::Tensor&) { backward_prefetched = layer1->is_gathering(); });
  });
  loss_of(*model, ids);
  CHECK(forward_prefetched);
  CHECK(backward_prefetched);
  for (const auto& unit : state->units()) CHECK_FALSE(unit->is_gathering());  // nothing left in flight
}

TEST_CASE("a unit gathers after its own host update, and is not prefetched while it is pending", "[fsdp]") {
  auto ids = torch::randint(0, 40, {3, 9}, torch::kLong);
  // An update: every owned shard halved. In the step on one model, on a host thread on the other.
  auto halve = [](FsdpUnit& unit) {
    at::NoGradGuard no_grad;
    for (auto& p : unit.params()) p.owned.detach().mul_(0.5);
  };
  auto in_step = tiny(false), later = tiny(false);
  auto in_step_state = shard(*in_step), later_state = shard(*later);
  loss_of(*in_step, ids);
  loss_of(*later, ids);  // records the order the next forward gathers in
  for (const auto& unit : in_step_state->units()) halve(*unit);
  const double expected = loss_of(*in_step, ids);

  const auto batches = later_state->host_update_batches();
  REQUIRE(batches.size() == later_state->units().size());  // every unit trains, on the host
  std::vector<std::promise<void>> done(batches.size());
  std::vector<std::shared_future<void>> updates;
  for (auto& d : done) updates.push_back(d.get_future().share());
  later_state->expect_host_updates(updates);
  // The batches follow the forward's order, so the units are found by their shards.
  std::vector<FsdpUnit*> order;
  for (const auto& batch : batches) {
    for (const auto& unit : later_state->units()) {
      if (unit->params().front().owned.is_same(batch.front())) order.push_back(unit.get());
    }
  }
  REQUIRE(order.size() == batches.size());
  // Each update lands 200 ms after the one before: a forward that read a unit's masters before
  // its update would see them unhalved, and layer 2 is still pending when layer 1 runs.
  std::thread host([&] {
    for (size_t k = 0; k < order.size(); ++k) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      halve(*order[k]);
      done[k].set_value();
    }
  });
  FsdpUnit* layer2 = nullptr;
  for (const auto& unit : later_state->units()) {
    if (unit->name() == "model.layers.2") layer2 = unit.get();
  }
  REQUIRE(layer2 != nullptr);
  bool layer2_pending = false, layer2_prefetched = false;
  find_module(*later, "model.layers.1")->add_pre_forward_hook([&](Module&, Module::Tensors&) {
    layer2_pending = layer2->update_pending();
    layer2_prefetched = layer2->is_gathering();
  });
  const double loss = loss_of(*later, ids);
  host.join();
  CHECK(loss == expected);
  CHECK(layer2_pending);
  CHECK_FALSE(layer2_prefetched);

  // Reading a unit's full values waits for its update too: halved once more on a host thread,
  // the last unit's values, asked for at once, are the in-step model's halved again.
  for (const auto& unit : in_step_state->units()) halve(*unit);
  std::vector<std::promise<void>> again(order.size());
  updates.clear();
  for (auto& d : again) updates.push_back(d.get_future().share());
  later_state->expect_host_updates(updates);
  std::thread again_host([&] {
    for (size_t k = 0; k < order.size(); ++k) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      halve(*order[k]);
      again[k].set_value();
    }
  });
  std::map<std::string, at::Tensor> read, want;
  order.back()->for_each_full_value([&](const std::string& name, const at::Tensor& t) { read[name] = t.clone(); });
  again_host.join();
  for (const auto& unit : in_step_state->units()) {
    if (unit->name() != order.back()->name()) continue;
    unit->for_each_full_value([&](const std::string& name, const at::Tensor& t) { want[name] = t.clone(); });
  }
  REQUIRE(!want.empty());
  REQUIRE(read.size() == want.size());
  for (const auto& [name, value] : want) {
    INFO(name);
    CHECK(at::equal(read.at(name), value));
  }
}

TEST_CASE("a training forward keeps its cast shards for backward's gather, and no longer", "[fsdp]") {
  auto model = tiny(false);
  auto state = shard(*model, at::kBFloat16);
  auto ids = torch::randint(0, 40, {3, 9}, torch::kLong);
  auto kept = [&] {
    int count = 0;
    for (const auto& unit : state->units()) count += unit->keeps_cast_shard();
    return count;
  };
  auto loss = next_token_loss_sum((*model)(ids.narrow(1, 0, 8)), ids.narrow(1, 1, 8));
  CHECK(kept() == 4);  // three layers and the embedding reshard after forward; the root does not
  loss.backward();
  CHECK(kept() == 0);  // each unit's backward gather took its own
  {
    at::NoGradGuard no_grad;  // no backward follows an evaluation
    (*model)(ids.narrow(1, 0, 8));
  }
  CHECK(kept() == 0);
  (*model)(ids.narrow(1, 0, 8));
  state->reshard_all();  // the optimizer is about to change the masters
  CHECK(kept() == 0);
}

TEST_CASE("in a group of one the parameters view the kept cast shard, forward and backward", "[fsdp]") {
  auto model = tiny(false);
  auto state = shard(*model, at::kBFloat16);
  FsdpUnit* layer = nullptr;
  for (const auto& unit : state->units()) {
    if (unit->name() == "model.layers.1") layer = unit.get();
  }
  REQUIRE(layer != nullptr);
  Module& module = *find_module(*model, "model.layers.1");
  std::vector<const char*> forward, backward;  // where each parameter's values are
  auto record = [&](std::vector<const char*>& where) {
    where.clear();
    for (const auto& p : layer->params()) where.push_back(static_cast<const char*>(p.param.const_data_ptr()));
  };
  // Hooks added after FSDP's run after them: the unit is gathered.
  module.add_pre_forward_hook([&](Module&, Module::Tensors&) { record(forward); });
  module.add_post_forward_hook([&](Module&, torch::Tensor& output) {
    output.register_hook([&](const at::Tensor&) { record(backward); });
  });
  CHECK(loss_and_joint(*model, torch::randint(0, 40, {3, 9}, torch::kLong)).second);  // bf16 too
  const auto& params = layer->params();
  REQUIRE(forward.size() == params.size());
  for (size_t i = 0; i + 1 < params.size(); ++i) {
    INFO(params[i].name << " then " << params[i + 1].name);
    CHECK(forward[i + 1] == forward[i] + params[i].numel() * 2);  // bf16, end to end in one buffer
  }
  CHECK(backward == forward);  // backward's gather is the forward's cast shard itself
  for (const auto& p : params) CHECK_FALSE(p.is_full());
}

TEST_CASE("plans are validated: tied parameters, paths, duplicates, meshes", "[fsdp]") {
  auto model = tiny(true);
  auto error_of = [&](Plan plan, int world) -> std::string {
    try {
      resolve_plan(plan, *model, world, at::kFloat);
    } catch (const UserError& e) {
      return e.what();
    }
    return "";
  };
  CHECK_THAT(error_of({.units = {{.modules = {"model.embed_tokens"}, .origin = "p.lua:3"}}}, 1),
             Catch::Contains("p.lua:3") && Catch::Contains("tied parameters model.embed_tokens.weight and lm_head.weight"));
  CHECK(error_of({.units = {{.modules = {"lm_head"}, .origin = "p.lua:2"}}}, 1) ==
        "p.lua:2: tied parameters lm_head.weight and model.embed_tokens.weight must be in one unit, but unit lm_head "
        "holds only the first");
  CHECK(error_of({.units = {{.modules = {"model.embed_tokens", "lm_head"}}}}, 1).empty());
  CHECK(error_of({.units = {{.modules = {"model.layers.0", "model.layers.0"}, .origin = "p.lua:7"}}}, 1) ==
        "p.lua:7: one wrap lists module 'model.layers.0' twice");
  CHECK_THAT(error_of({.units = {{.modules = {"model.layers.7"}, .origin = "p.lua:4"}}}, 1),
             Catch::Contains("p.lua:4: no module at path 'model.layers.7'"));
  CHECK_THAT(error_of({.units = {{.modules = {"model.layers.0"}}, {.modules = {"model.layers.0"}, .origin = "p.lua:9"}}}, 1),
             Catch::Contains("p.lua:9: module 'model.layers.0' is already wrapped"));
  CHECK_THAT(error_of({.units = {{.modules = {"model.layers.0"}, .mesh = {.replicate = 2, .shard = 3}}}}, 4),
             Catch::Contains("mesh replicate 2 × shard 3 ≠ world 4"));
  CHECK_THAT(error_of({}, 1), Catch::Contains("policy wrapped nothing"));
  // A unit left with no parameter (a root whose modules are all in units) gathers nothing: the
  // plan leaves it out. Plans that cannot run are refused before any step, naming the line.
  const auto rootless = resolve_plan({.units = {{.modules = {"model", "lm_head"}}, {.modules = {""}}}}, *model, 1,
                                     at::kFloat);
  REQUIRE(rootless.units.size() == 1);
  CHECK(rootless.units[0].name == "model+lm_head");
  // One that declares checkpointing or precision for its forward would declare them for
  // nothing: refused, naming the line.
  CHECK(error_of({.units = {{.modules = {"model.layers.0.self_attn"}}, {.modules = {"model.layers.0.mlp"}},
                            {.modules = {"model.layers.0.input_layernorm"}},
                            {.modules = {"model.layers.0.post_attention_layernorm"}},
                            {.modules = {"model.layers.0"}, .activation_checkpoint = true, .origin = "p.lua:5"}}},
                 1) ==
        "p.lua:5: wrap of model.layers.0: every parameter under it belongs to a unit inside it, so it has none of its "
        "own to gather and is left out, and its activation_checkpoint, precision and offload would apply to nothing; "
        "declare them on the units inside it, or wrap it alone");
  CHECK(error_of({.units = {{.modules = {"model", "lm_head"}}, {.modules = {""}, .output_dtype = at::kFloat,
                                                                .origin = "p.lua:8"}}},
                 1) != "");
  CHECK(error_of({.units = {{.modules = {"model.layers"}, .origin = "p.lua:2"}}}, 1) ==
        "p.lua:2: module 'model.layers' is a ModuleList, which has no forward of its own (its owner calls each child): "
        "wrap its children");
  CHECK(error_of({.units = {{.modules = {"model.layers.0", "model.layers.0.mlp"}, .origin = "p.lua:6"}}}, 1) ==
        "p.lua:6: one wrap lists 'model.layers.0.mlp' and 'model.layers.0', which holds it; list either, or wrap the "
        "inner one in a unit of its own");
  // k ranks' worth of reshard_after_forward on a one-rank shard group frees everything, as
  // it does on k ranks.
  const auto single = resolve_plan({.units = {{.modules = {"model.layers.0"}, .reshard_after_forward = 2}}}, *model, 1,
                                   at::kFloat);
  CHECK(single.units[0].reshard_after_forward == kWholeShardGroup);
  CHECK_THAT(error_of({.units = {{.modules = {"model.layers.0"}, .reshard_after_forward = 2}}}, 3),
             Catch::Contains("reshard_after_forward = 2 does not divide the unit's shard size 3"));
  // Inner units first, the root last with what is left.
  Plan plan{.units = {{.modules = {""}}, {.modules = {"model.layers.1"}}}};
  const auto resolved = resolve_plan(plan, *model, 2, at::kFloat);
  REQUIRE(resolved.units.size() == 2);
  CHECK(resolved.units[0].name == "model.layers.1");
  CHECK(resolved.units[1].name == "<root>");
  CHECK(resolved.units[0].numel + resolved.units[1].numel == model->recursive_param_count());
}

TEST_CASE("a unit's modules listed out of forward order stop the forward with the unit's name", "[fsdp]") {
  auto model = tiny(false);
  Plan plan{.units = {{.modules = {"model.layers.1", "model.layers.0"}}, {.modules = {""}}}};
  FsdpState state(*model, Comm::single(), resolve_plan(plan, *model, 1, at::kFloat));
  const auto ids = torch::randint(0, 40, {2, 6}, torch::kLong);
  CHECK_THROWS_WITH((*model)(ids),
                    "unit model.layers.1+model.layers.0: the forward called its module 2 of 2 (LlamaDecoderLayer) "
                    "before the first (LlamaDecoderLayer) or after the last; list a unit's modules in the order the "
                    "forward calls them");
}

TEST_CASE("a recomputed unit casts its inputs as its forward did, inside a unit of another dtype", "[fsdp]") {
  // Each layer's attention gathers in float32 inside its float64 layer, which recomputes in
  // backward: the recomputation must hand the attention float32 as the forward did.
  auto config = tiny(false)->config();
  auto model = build_model(config, torch::TensorOptions().dtype(at::kDouble));
  init_parameters(*model, 5, 0.1);
  auto twin = build_model(config, torch::TensorOptions().dtype(at::kDouble));
  {
    at::NoGradGuard no_grad;
    const auto from = unique_named_parameters(*model);
    const auto to = unique_named_parameters(*twin);
    for (size_t i = 0; i < from.size(); ++i) to[i].tensor.copy_(from[i].tensor);
  }
  const auto plan_of = [](bool recompute) {
    Plan plan;
    for (int layer = 0; layer < 3; ++layer) {
      const std::string path = "model.layers." + std::to_string(layer);
      plan.units.push_back({.modules = {path + ".self_attn"}, .param_dtype = at::kFloat, .output_dtype = at::kDouble});
      plan.units.push_back({.modules = {path}, .activation_checkpoint = recompute});
    }
    plan.units.push_back({.modules = {""}});
    return plan;
  };
  FsdpState recomputed(*model, Comm::single(), resolve_plan(plan_of(true), *model, 1, at::kDouble));
  FsdpState kept(*twin, Comm::single(), resolve_plan(plan_of(false), *twin, 1, at::kDouble));
  const auto ids = torch::randint(0, 40, {2, 9}, torch::kLong);
  CHECK(loss_of(*model, ids) == loss_of(*twin, ids));
  const auto a = recomputed.sharded_parameters();
  const auto b = kept.sharded_parameters();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].name);
    CHECK(at::equal(a[i].tensor.grad(), b[i].tensor.grad()));
  }
}

TEST_CASE("layers computing in float32 inside a bf16 root hand its products an input they cast to bf16", "[fsdp]") {
  // No layer casts its output: the root's final norm returns float32 (its bf16 weight times a
  // float32 input, as transformers' norm does), which lm_head multiplies in its own bf16.
  auto model = tiny(false);
  auto twin = tiny(false);
  Plan plan;
  for (int layer = 0; layer < 3; ++layer) {
    plan.units.push_back({.modules = {"model.layers." + std::to_string(layer)}, .param_dtype = at::kFloat});
  }
  plan.units.push_back({.modules = {""}, .param_dtype = at::kBFloat16});
  FsdpState state(*model, Comm::single(), resolve_plan(plan, *model, 1, at::kFloat));
  const auto ids = torch::randint(0, 40, {2, 9}, torch::kLong);
  const auto logits = (*model)(ids);
  CHECK(logits.scalar_type() == at::kBFloat16);
  const double mixed = loss_of(*model, ids), full = loss_of(*twin, ids);
  CHECK(std::abs(mixed - full) < 2e-2 * std::abs(full));
  for (const auto& p : state.sharded_parameters()) {
    INFO(p.name);
    CHECK(p.tensor.grad().defined());
  }
  // The cast is the product's first step: bitwise what an input already in bf16 gives.
  Linear head(30, 40, /*bias=*/true, torch::TensorOptions().dtype(at::kBFloat16));
  {
    at::NoGradGuard no_grad;
    head.weight.copy_(torch::randn({40, 30}));
    head.bias.copy_(torch::randn({40}));
  }
  const auto x = torch::randn({3, 30});
  CHECK(at::equal(head(x), head(x.to(at::kBFloat16))));
}

TEST_CASE("a frozen base computed in bf16 is held in bf16 alone and computes what fp32 masters would", "[fsdp]") {
  auto lora = tiny_lora();
  auto reference = tiny_lora();  // the same values with nothing frozen: every shard an fp32 master
  for (const auto& p : unique_named_parameters(*reference)) p.tensor.set_requires_grad(true);
  const ResolvedPlan plan = plan_for(*lora, at::kBFloat16);
  FsdpState state(*lora, Comm::single(), plan);
  auto reference_state = shard(*reference, at::kBFloat16);

  int64_t bytes = 0, constant_bytes = 0;
  for (const auto& unit : state.units()) {
    for (const auto& p : unit->params()) {
      INFO(p.name);
      CHECK(p.local.scalar_type() == (p.param.requires_grad() ? at::kFloat : at::kBFloat16));
      bytes += p.local.numel() * p.local.element_size();
      if (!p.param.requires_grad()) constant_bytes += p.local.numel() * p.local.element_size();
    }
  }
  CHECK(constant_bytes > 0);
  CHECK(plan.param_bytes == bytes);  // what `fsdpp plan` predicts is what the shards hold
  CHECK(plan.constant_param_bytes == constant_bytes);

  auto ids = torch::randint(0, 40, {3, 9}, torch::kLong);
  for (int step = 0; step < 2; ++step) {
    const double expected = loss_of(*reference, ids);
    CHECK(loss_of(*lora, ids) == Approx(expected).epsilon(1e-6));
  }
  std::map<std::string, at::Tensor> reference_grads;
  for (const auto& p : reference_state->sharded_parameters()) reference_grads[p.name] = p.tensor.grad();
  int trained = 0;
  for (const auto& p : state.sharded_parameters()) {
    INFO("gradient of " << p.name);
    CHECK(p.tensor.grad().defined() == p.tensor.requires_grad());
    if (!p.tensor.requires_grad()) continue;
    ++trained;
    CHECK(p.tensor.grad().abs().max().item<float>() > 0);
    CHECK(torch::allclose(p.tensor.grad(), reference_grads.at(p.name), 1e-5, 1e-7));
  }
  CHECK(trained == 5);  // two adapters' A and B, and model.norm

  // Computing in fp32, frozen parameters keep their fp32 shards: nothing narrower to hold.
  CHECK(plan_for(*lora, std::nullopt).constant_param_bytes == 0);
}

TEST_CASE("a routing bias the run moves keeps its master when the rest of a frozen base goes bf16", "[fsdp]") {
  auto config = ModelConfig::from_json(
      {{"model_type", "deepseek_v3"}, {"vocab_size", 40}, {"hidden_size", 30}, {"intermediate_size", 50},
       {"num_hidden_layers", 2}, {"num_attention_heads", 3}, {"num_key_value_heads", 3}, {"kv_lora_rank", 10},
       {"qk_nope_head_dim", 6}, {"qk_rope_head_dim", 4}, {"v_head_dim", 6}, {"n_routed_experts", 4},
       {"n_group", 2}, {"topk_group", 1}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 6},
       {"first_k_dense_replace", 1}},
      "test");
  auto model = build_model(config, torch::TensorOptions().device(torch::kMeta));
  apply_lora(*model, {.targets = {"model.layers.1.self_attn.o_proj"}, .rank = 2, .alpha = 2}, torch::TensorOptions());
  const ResolvedPlan plan = resolve_plan({.units = {{.modules = {""}, .param_dtype = at::kBFloat16}}}, *model, 2,
                                         at::kFloat);
  int biases = 0, constants = 0;
  for (const auto& p : plan.units.front().params) {
    INFO(p.name);
    const bool bias = p.name.ends_with(".e_score_correction_bias");
    const bool adapter = is_adapter_parameter(p.name);
    biases += bias;
    constants += p.constant;
    CHECK(p.constant == (!bias && !adapter));
  }
  CHECK(biases == 1);
  CHECK(constants > 0);
}

TEST_CASE("layers that declare float8 products multiply in float8 on a GPU and follow bf16's loss and gradients",
          "[fsdp][gpu]") {
  if (!gpu_half_runs()) return;
  const at::Device gpu(at::kCUDA, 0);
  REQUIRE(fp8_products_run(gpu));
  // Every width a multiple of 16, as the FP8 matrix units take them.
  const auto config = ModelConfig::from_json(
      {{"model_type", "llama"}, {"vocab_size", 64}, {"hidden_size", 64}, {"intermediate_size", 128},
       {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
       {"tie_word_embeddings", false}},
      "test");
  auto sharded = [&](ProductPrecision compute, at::ScalarType dtype) {
    auto model = build_model(config, torch::TensorOptions());
    init_parameters(*model, 5, 0.1);
    Plan plan;
    for (const auto& e : named_modules(*model)) {
      if (e.module->class_name().ends_with("DecoderLayer")) {
        plan.units.push_back({.modules = {e.path}, .param_dtype = dtype, .compute = compute});
      }
    }
    plan.units.push_back({.modules = {""}, .reshard_after_forward = 1, .param_dtype = dtype});
    auto state = std::make_unique<FsdpState>(*model, Comm::single(), resolve_plan(plan, *model, 1, at::kFloat),
                                             ShardFill{}, gpu);
    return std::pair{model, std::move(state)};
  };
  auto [fp8, fp8_state] = sharded(ProductPrecision::fp8, at::kBFloat16);
  auto [bf16, bf16_state] = sharded(ProductPrecision::param, at::kBFloat16);
  auto [fp32, fp32_state] = sharded(ProductPrecision::param, at::kFloat);
  // The layers' projections multiply in float8; lm_head, in the root unit, does not.
  int marked = 0;
  for (const auto& e : named_modules(*fp8)) {
    if (auto* linear = dynamic_cast<Linear*>(e.module)) {
      INFO(e.path);
      CHECK(linear->fp8_products == (e.path.find("layers.") != std::string::npos));
      marked += linear->fp8_products ? 1 : 0;
    }
  }
  CHECK(marked == 14);

  const auto ids = torch::randint(0, 64, {4, 33}, torch::kLong).to(gpu);
  auto loss_of = [&](CausalLM& model, bool expect_fp8) {
    auto loss = next_token_loss_sum(model(ids.narrow(1, 0, 32)), ids.narrow(1, 1, 32)) / 128.0;
    CHECK(backward_runs(loss, "Fp8Linear") == expect_fp8);
    loss.backward();
    return loss.item<double>();
  };
  const double expected = loss_of(*bf16, false);
  CHECK(loss_of(*fp8, true) == Approx(expected).epsilon(0.02));
  loss_of(*fp32, false);
  // Each gradient's distance from fp32's, bounded by bf16's own: e4m3 keeps 3 mantissa bits to
  // bf16's 7, so its rounding is 16 times coarser; twice that leaves room for the order in which
  // the matrix units sum. The bound is measured, not chosen, as the parity checks' are.
  std::map<std::string, at::Tensor> fp32_grads, bf16_grads;
  for (const auto& p : fp32_state->sharded_parameters()) fp32_grads[p.name] = p.tensor.grad().to(at::kDouble);
  for (const auto& p : bf16_state->sharded_parameters()) bf16_grads[p.name] = p.tensor.grad().to(at::kDouble);
  for (const auto& p : fp8_state->sharded_parameters()) {
    INFO("gradient of " << p.name);
    const auto& reference = fp32_grads.at(p.name);
    const double bf16_error = (bf16_grads.at(p.name) - reference).norm().item<double>();
    const double fp8_error = (p.tensor.grad().to(at::kDouble) - reference).norm().item<double>();
    CAPTURE(bf16_error, fp8_error, reference.norm().item<double>());
    CHECK(fp8_error <= 32 * bf16_error);
  }
}

TEST_CASE("offloaded gradients leave the GPU with their norms taken there, which clipping then uses", "[fsdp][gpu]") {
  if (!gpu_half_runs()) return;
  const at::Device gpu(at::kCUDA, 0);
  auto model = tiny(false);
  Plan plan;
  for (const auto& e : named_modules(*model)) {
    if (e.module->class_name().ends_with("DecoderLayer")) {
      plan.units.push_back({.modules = {e.path}, .offload = Offload::cpu});
    }
  }
  plan.units.push_back({.modules = {""}, .reshard_after_forward = 1});
  FsdpState state(*model, Comm::single(), resolve_plan(plan, *model, 1, at::kFloat), ShardFill{}, gpu);
  const auto ids = torch::randint(0, 40, {3, 9}, torch::kLong).to(gpu);
  loss_of(*model, ids);
  auto groups = state.grad_groups();
  REQUIRE(groups.size() == 1);
  GradGroup& group = groups.front();
  int known = 0;
  for (size_t i = 0; i < group.params.size(); ++i) {
    const at::Tensor& grad = group.params[i].grad();
    INFO("parameter " << i << " on " << grad.device());
    // Offloaded gradients, on the host, alone come with a norm, taken on the GPU.
    REQUIRE(group.grad_norms[i].defined() == grad.is_cpu());
    if (!grad.is_cpu()) continue;
    ++known;
    CHECK(group.grad_norms[i].device() == gpu);
    CHECK(group.grad_norms[i].item<double>() == Approx(at::linalg_vector_norm(grad).item<double>()).epsilon(1e-6));
  }
  CHECK(known == 3 * 9);  // each layer's two norms and seven projections
  const GradClip with_norms = clip_by_norm(groups, 0.5);
  CHECK(with_norms.norm.device() == gpu);  // summed where the norms are: the host reads it once
  group.grad_norms.clear();
  CHECK(with_norms.norm.item<double>() == Approx(clip_by_norm(groups, 0.5).norm.item<double>()).epsilon(1e-6));
  // A gradient changed after it landed (an average over ranks) is read again.
  group.params.front().grad().mul_(2);
  CHECK_FALSE(state.grad_groups().front().grad_norms.front().defined());
}

TEST_CASE("a MoE layer's router and routed experts keep bf16 products in a float8 unit", "[fsdp][gpu]") {
  if (!gpu_half_runs()) return;
  const at::Device gpu(at::kCUDA, 0);
  REQUIRE(fp8_products_run(gpu));
  // Widths in multiples of 16, so only the rule, not the shapes, keeps a layer in bf16.
  const auto config = ModelConfig::from_json(
      {{"model_type", "qwen3_moe"}, {"vocab_size", 64}, {"hidden_size", 64}, {"intermediate_size", 128},
       {"num_hidden_layers", 1}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 16},
       {"num_experts", 16}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 32}, {"norm_topk_prob", true}},
      "test");
  auto model = build_model(config, torch::TensorOptions());
  init_parameters(*model, 5, 0.1);
  Plan plan;
  plan.units.push_back({.modules = {"model.layers.0"}, .param_dtype = at::kBFloat16, .compute = ProductPrecision::fp8});
  plan.units.push_back({.modules = {""}, .reshard_after_forward = 1, .param_dtype = at::kBFloat16});
  FsdpState state(*model, Comm::single(), resolve_plan(plan, *model, 1, at::kFloat), ShardFill{}, gpu);
  int fp8 = 0, bf16 = 0;
  for (const auto& e : named_modules(*model)) {
    auto* linear = dynamic_cast<Linear*>(e.module);
    if (linear == nullptr || e.path.find("layers.0.") == std::string::npos) continue;
    INFO(e.path);
    const bool routing = e.path.ends_with("mlp.gate") || e.path.find(".experts.") != std::string::npos;
    CHECK(linear->fp8_products == !routing);
    (linear->fp8_products ? fp8 : bf16) += 1;
  }
  CHECK(fp8 == 4);             // q, k, v and o
  CHECK(bf16 == 1 + 16 * 3);   // the router and every expert's three projections
}

#ifdef FSDPP_TESTS_SEE_DEVICE_WAITS
TEST_CASE("a forward and backward through bf16 units on a GPU never wait for the device", "[fsdp][gpu]") {
  if (!gpu_half_runs()) return;
  const at::Device gpu(at::kCUDA, 0);
  // A tied Llama (the embedding's backward adds into lm_head's gradient), a Qwen3 (q and k
  // norms) and a Qwen3-MoE layer whose experts run in one grouped product (widths in
  // multiples of 16 bytes). The host is then free to queue the whole step ahead of the GPU.
  const std::string model_type = GENERATE("llama", "qwen3", "qwen3_moe");
  INFO(model_type);
  auto config = ModelConfig::from_json(
      {{"model_type", model_type}, {"vocab_size", 64}, {"hidden_size", 64}, {"intermediate_size", 128},
       {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 16},
       {"tie_word_embeddings", model_type == "llama"}, {"num_experts", 8}, {"num_experts_per_tok", 2},
       {"moe_intermediate_size", 32}},
      "test");
  auto model = build_model(config, torch::TensorOptions());
  init_parameters(*model, 5, 0.1);
  FsdpState state(*model, Comm::single(), plan_for(*model, at::kBFloat16), ShardFill{}, gpu);
  const auto ids = torch::randint(0, 64, {2, 33}, torch::kLong).to(gpu);
  at::Tensor loss;
  {
    DeviceWaitsRaise raise;
    loss = next_token_loss_sum((*model)(ids.narrow(1, 0, 32)), ids.narrow(1, 1, 32)) / 64.0;
    loss.backward();
  }
  CHECK(std::isfinite(loss.item<double>()));
  for (const auto& p : state.sharded_parameters()) {
    INFO(p.name);
    CHECK((p.tensor.grad().defined() && p.tensor.grad().isfinite().all().item<bool>()));
  }
}
#endif
