// Shard arithmetic, read from the tensors: at every world size each rank holds
// ceil(rows / world) padded rows per parameter, the owned rows of all ranks concatenate to
// the original, and every rank holds the same padded size, less than one row per parameter
// per rank above an even split.
#include "core/module_tree.h"
#include "fsdp/fsdp_state.h"
#include "fsdp/sharded_param.h"
#include "models/registry.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

using namespace fsdpp;

TEST_CASE("shards hold ceil(rows / world) padded rows and owned rows rebuild the tensor", "[fsdp]") {
  auto config = ModelConfig::from_json(
      {{"model_type", "llama"}, {"vocab_size", 37}, {"hidden_size", 30}, {"intermediate_size", 50},
       {"num_hidden_layers", 2}, {"num_attention_heads", 3}, {"num_key_value_heads", 1}},
      "test");
  const int world = GENERATE(1, 2, 3, 4, 7);
  INFO("world " << world);
  int64_t padded_total = 0;
  std::vector<int64_t> rank_numel(static_cast<size_t>(world), 0);
  for (const auto& p : unique_named_parameters(*[&] {
         auto m = build_model(config, torch::TensorOptions());
         init_parameters(*m, 1, 0.1);
         return m;
       }())) {
    std::vector<at::Tensor> owned;
    const int64_t rows = p.tensor.size(0);
    const int64_t padded_rows = (rows + world - 1) / world;
    for (int rank = 0; rank < world; ++rank) {
      ShardedParam shard(p.name, p.tensor, rank, world);
      CHECK(shard.padded_rows == padded_rows);
      CHECK(shard.first_row == std::min(rows, rank * padded_rows));
      CHECK(shard.local.numel() == padded_rows * shard.row_numel);
      // Padding rows are zero so reductions over whole shards ignore them.
      CHECK(shard.local.narrow(0, shard.owned.numel(), shard.local.numel() - shard.owned.numel())
                .abs().sum().item<double>() == 0.0);
      owned.push_back(shard.owned.detach());
      rank_numel[static_cast<size_t>(rank)] += shard.local.numel();
    }
    CHECK(torch::equal(at::cat(owned), p.tensor));
    // Padding stays under one row per rank: whole shards exceed the tensor by fewer than world rows.
    CHECK(padded_rows * world - rows < world);
    padded_total += padded_rows * world * (p.tensor.numel() / rows);
  }
  // Every rank holds the same number of elements (one flat collective buffer per unit).
  for (int64_t n : rank_numel) CHECK(n * world == padded_total);
}

TEST_CASE("a meta build allocates nothing and each rank initialises only its rows", "[fsdp]") {
  auto config = ModelConfig::from_json(
      {{"model_type", "llama"}, {"vocab_size", 37}, {"hidden_size", 30}, {"intermediate_size", 50},
       {"num_hidden_layers", 2}, {"num_attention_heads", 3}, {"num_key_value_heads", 1}},
      "test");
  auto materialised = build_model(config, torch::TensorOptions());
  init_parameters(*materialised, 9, 0.05);
  auto unallocated = build_model(config, torch::TensorOptions().device(torch::kMeta));
  size_t bytes = 0;
  for (const auto& p : unique_named_parameters(*unallocated)) {
    CHECK_FALSE(is_allocated(p.tensor));
    bytes += p.tensor.storage().nbytes();
  }
  CHECK(bytes == 0);
  CHECK(unallocated->recursive_param_count() == materialised->recursive_param_count());

  const int world = 3;
  auto reference = unique_named_parameters(*materialised);
  const ShardFill fill = fresh_init_fill(*unallocated, 9, 0.05);
  size_t i = 0;
  for (const auto& entry : named_modules(*unallocated)) {
    for (auto& item : entry.module->named_parameters(/*recurse=*/false)) {
      const std::string name = entry.path + "." + item.key();
      REQUIRE(reference[i].name == name);
      std::vector<at::Tensor> owned;
      for (int rank = 0; rank < world; ++rank) {
        ShardedParam shard(name, item.value(), rank, world, fill);
        owned.push_back(shard.owned.detach());
        CHECK_FALSE(shard.is_full());  // the module's tensor stays unallocated
      }
      INFO(name);
      CHECK(torch::equal(at::cat(owned), reference[i].tensor));
      ++i;
    }
  }
  CHECK(i == reference.size());
}

TEST_CASE("a gradient's noted norm holds while the gradient stays the same tensor, unchanged", "[fsdp]") {
  auto weight = at::randn({6, 4}).requires_grad_(true);
  ShardedParam shard("w", weight, /*rank=*/0, /*world=*/2);
  CHECK_FALSE(shard.known_grad_norm().defined());  // no gradient yet
  shard.owned.mutable_grad() = at::randn(shard.owned.sizes());
  const at::Tensor norm = at::linalg_vector_norm(shard.owned.grad());
  shard.note_grad_norm(norm);
  CHECK(shard.known_grad_norm().is_same(norm));
  shard.owned.grad().div_(2);  // a caller's change in place (an average over ranks)
  CHECK_FALSE(shard.known_grad_norm().defined());
  shard.note_grad_norm(at::linalg_vector_norm(shard.owned.grad()));
  shard.owned.mutable_grad() = shard.owned.grad().clone();  // replaced by equal values
  CHECK_FALSE(shard.known_grad_norm().defined());
  shard.note_grad_norm(at::linalg_vector_norm(shard.owned.grad()));
  shard.owned.mutable_grad() = at::Tensor();  // dropped
  CHECK_FALSE(shard.known_grad_norm().defined());
}
