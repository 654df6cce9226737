// The generation cache's bookkeeping: positions that count a row's tokens past its left
// padding, masks that hide padding and the future (and what lies past a sliding window), and
// keys appended in place.
#include "models/kv_cache.h"

#include "tensor_checks.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include <tuple>

using namespace fsdpp;

namespace {
at::Tensor flags(const std::vector<int64_t>& values) { return int64s(values).to(at::kBool); }
}  // namespace

TEST_CASE("a left-padded prompt's tokens count from 0, and no query sees padding or the future", "[models]") {
  KvCache cache(/*layers=*/1, /*capacity=*/6, /*window=*/0);
  const CachedStep prompt = cache.begin_step(flags({0, 0, 1, 1}).view({1, 4}));
  CHECK(prompt.positions.equal(int64s({0, 0, 0, 1}).view({1, 4})));
  // The prompt attends as a training forward does, over its padding and its tokens as two documents.
  CHECK_FALSE(prompt.scope.defined());
  CHECK(prompt.documents.equal(int64s({0, 2, 4})));
  const CachedStep next = cache.begin_step(flags({1}).view({1, 1}));
  CHECK(next.positions.equal(int64s({2}).view({1, 1})));
  CHECK(next.scope.equal(flags({0, 0, 1, 1, 1}).view({1, 1, 1, 5})));
  CHECK(cache.cached() == 5);
}

TEST_CASE("rows padded on the left are documents of their padding and their tokens", "[models]") {
  CHECK(left_padded_documents(flags({0, 1, 1, 1, 1, 1, 0, 0, 1}).view({3, 3})).equal(int64s({0, 1, 3, 6, 8, 9})));
  KvCache unpadded(1, 4, 0);
  CHECK_FALSE(unpadded.begin_step(flags({1, 1}).view({1, 2})).documents.defined());
}

TEST_CASE("a sliding window hides the keys it has passed", "[models]") {
  KvCache cache(1, 6, /*window=*/2);
  cache.begin_step(flags({1, 1, 1}).view({1, 3}));
  const CachedStep next = cache.begin_step(flags({1}).view({1, 1}));
  CHECK(next.positions.equal(int64s({3}).view({1, 1})));
  CHECK(next.scope.equal(flags({0, 0, 1, 1}).view({1, 1, 1, 4})));
}

TEST_CASE("a layer's keys and values are appended, its room doubling up to the capacity", "[models]") {
  LayerCache layer;
  const auto first = at::randn({2, 1, 3, 4}, at::kDouble), second = at::randn({2, 1, 1, 4}, at::kDouble);
  layer.append(first, first * 2, /*capacity=*/8);
  CHECK(layer.key.size(2) == 3);  // no room past what the prompt holds
  auto [key, value] = layer.append(second, second * 2, 8);  // [2, 1, 4, 4]
  CHECK(layer.key.size(2) == 6);
  CHECK(key.equal(at::cat({first, second}, 2)));
  CHECK(value.equal(at::cat({first, second}, 2) * 2));
  for (int i = 0; i < 4; ++i) std::tie(key, value) = layer.append(second, second * 2, 8);
  CHECK(layer.key.size(2) == 8);  // capped at the capacity
  CHECK(key.narrow(2, 0, 4).equal(at::cat({first, second}, 2)));
  CHECK_THROWS(layer.append(second, second, 8));
}
