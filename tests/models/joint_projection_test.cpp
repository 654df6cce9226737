// Projections whose weights lie end to end run as one product with each projection's outputs
// and gradients; any that cannot (weights in storages of their own, a bias, an adapter, a
// hook) are left to their modules.
#include "models/joint_projection.h"
#include "tensor_checks.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

using namespace fsdpp;

namespace {

constexpr int64_t kIn = 7;  // odd widths: nothing lines up by accident

// Makes `weight`'s own storage hold `memory` (owned elsewhere), without a version bump: how
// FSDP moves a gathered parameter.
void point_at(const at::Tensor& weight, double* memory) {
  weight.storage().unsafeGetStorageImpl()->set_data_ptr_noswap(at::DataPtr(memory, weight.device()));
}

// Three bias-free projections of kIn inputs to 6, 3 and 3 outputs, in float64.
std::vector<std::shared_ptr<Linear>> projections() {
  std::vector<std::shared_ptr<Linear>> linears;
  for (int64_t out : {6, 3, 3}) linears.push_back(std::make_shared<Linear>(kIn, out, false, at::kDouble));
  at::manual_seed(3);
  at::NoGradGuard no_grad;
  for (auto& l : linears) l->weight.copy_(at::randn(l->weight.sizes(), at::kDouble));
  return linears;
}

// Points each projection's weight, values kept, at its place in one buffer, as a unit's
// gathered parameters are placed in a shard group of one (each keeps its own storage, whose
// memory the buffer owns). Returns the buffer.
at::Tensor place_end_to_end(const std::vector<std::shared_ptr<Linear>>& linears) {
  std::vector<at::Tensor> values;
  for (const auto& l : linears) values.push_back(l->weight.detach().reshape({-1}));
  const auto buffer = at::cat(values);  // [Σ out × in]
  int64_t offset = 0;
  for (auto& l : linears) {
    point_at(l->weight, buffer.data_ptr<double>() + offset);
    offset += l->weight.numel();
  }
  return buffer;
}

std::vector<const Linear*> pointers(const std::vector<std::shared_ptr<Linear>>& linears) {
  return {linears[0].get(), linears[1].get(), linears[2].get()};
}

}  // namespace

TEST_CASE("projections whose weights lie end to end run as one product with each one's gradients", "[models]") {
  const bool frozen_middle = GENERATE(false, true);
  // Backward finds the weights apart when one moved after forward (its values kept).
  const bool moved_before_backward = GENERATE(false, true);
  INFO("middle weight frozen " << frozen_middle << ", last weight moved before backward " << moved_before_backward);
  auto linears = projections();
  const auto buffer = place_end_to_end(linears);
  if (frozen_middle) linears[1]->weight.requires_grad_(false);
  // The reference: each projection alone, on copies of the same weights.
  std::vector<at::Tensor> copies;
  for (const auto& l : linears) copies.push_back(l->weight.detach().clone().requires_grad_(l->weight.requires_grad()));
  const auto x = at::randn({2, 5, kIn}, at::kDouble).requires_grad_(true);  // [B, T, in]
  const auto x_alone = x.detach().clone().requires_grad_(true);

  const auto joint = joint_projection(pointers(linears), x);  // [B, T, 12]
  REQUIRE(joint.defined());
  CHECK(backward_runs(joint, "JointProjection"));
  std::vector<at::Tensor> alone;
  for (const auto& w : copies) alone.push_back(at::linear(x_alone, w));
  const auto expected = at::cat(alone, -1);
  CHECK(relative_error(joint, expected) < 1e-14);

  const auto upstream = at::randn(expected.sizes(), at::kDouble);
  const auto elsewhere = linears[2]->weight.detach().clone();
  if (moved_before_backward) point_at(linears[2]->weight, elsewhere.data_ptr<double>());
  joint.backward(upstream);
  expected.backward(upstream);
  CHECK(relative_error(x.grad(), x_alone.grad()) < 1e-14);
  for (size_t i = 0; i < linears.size(); ++i) {
    INFO("weight " << i);
    if (!copies[i].requires_grad()) {
      CHECK_FALSE(linears[i]->weight.grad().defined());
      continue;
    }
    REQUIRE(linears[i]->weight.grad().defined());
    CHECK(relative_error(linears[i]->weight.grad(), copies[i].grad()) < 1e-14);
  }
}

TEST_CASE("projections that cannot share one product are left to their modules", "[models]") {
  const auto x = at::randn({2, 5, kIn}, at::kDouble);
  SECTION("weights in storages of their own") { CHECK_FALSE(joint_projection(pointers(projections()), x).defined()); }
  SECTION("weights out of order") {
    auto linears = projections();
    const auto buffer = place_end_to_end(linears);
    CHECK_FALSE(joint_projection({linears[1].get(), linears[0].get(), linears[2].get()}, x).defined());
  }
  SECTION("a bias on one projection") {
    auto linears = projections();
    linears[1] = std::make_shared<Linear>(kIn, 3, true, at::kDouble);
    const auto buffer = place_end_to_end(linears);
    CHECK_FALSE(joint_projection(pointers(linears), x).defined());
  }
  SECTION("a hook on one projection") {
    auto linears = projections();
    const auto buffer = place_end_to_end(linears);
    linears[2]->add_pre_forward_hook([](Module&, Module::Tensors&) {});
    CHECK_FALSE(joint_projection(pointers(linears), x).defined());
  }
  SECTION("an adapter on one projection") {
    auto linears = projections();
    const auto buffer = place_end_to_end(linears);
    linears[0]->add_adapter(2, 4.0, 0.0, at::kDouble);
    CHECK_FALSE(joint_projection(pointers(linears), x).defined());
  }
  SECTION("an input of another dtype") {
    auto linears = projections();
    const auto buffer = place_end_to_end(linears);
    CHECK_FALSE(joint_projection(pointers(linears), x.to(at::kFloat)).defined());
  }
}
