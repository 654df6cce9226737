// A short example to copy when adding a test: build a real model, run it, check a property
// that would break if the code under test did. One file per source unit, mirroring engine/.
#include "core/module_tree.h"
#include "models/registry.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

using namespace fsdpp;

TEST_CASE("example: a fresh tiny Llama maps token ids to one logit row per token", "[example]") {
  // A config as Hugging Face would write it; only the keys the engine needs.
  const auto config = ModelConfig::from_json(
      {{"model_type", "llama"}, {"vocab_size", 37}, {"hidden_size", 24}, {"intermediate_size", 40},
       {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}},
      "example");
  auto model = build_model(config, torch::TensorOptions().dtype(torch::kFloat32));
  init_parameters(*model, /*seed=*/7, config.initializer_range);

  auto ids = torch::randint(0, 37, {3, 5}, torch::kLong);  // [B, T]
  auto logits = (*model)(ids);                             // [B, T, V]

  CHECK(logits.sizes() == torch::IntArrayRef({3, 5, 37}));
  // Causality: changing the last token must leave every earlier position's logits alone.
  auto changed = ids.clone();
  changed[0][4] = (ids[0][4].item<int64_t>() + 1) % 37;
  auto logits2 = (*model)(changed);
  CHECK(torch::equal(logits.narrow(1, 0, 4), logits2.narrow(1, 0, 4)));
  CHECK_FALSE(torch::equal(logits[0][4], logits2[0][4]));
}
