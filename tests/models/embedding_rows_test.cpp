// The embedding lookup whose backward adds into weight.grad: against ATen's embedding and its
// autograd, alone and tied to a linear head, over backward passes that accumulate, in float64,
// float32 and bf16, and on a GPU the same bits run after run, with no wait for the device.
#include "models/embedding_rows.h"

#include "device_waits.h"
#include "tensor_checks.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

using namespace fsdpp;

namespace {

struct Case {
  at::Tensor weight, ids, head_input, out_grad, head_grad;  // [V, C], [B, T], [B, T, C], [B, T, C], [B, T, V]
};

// Tokens that repeat (a vocabulary of 11 over 2 × 37 positions), in float64.
Case make_case() {
  at::manual_seed(13);
  return {at::randn({11, 6}, at::kDouble), at::randint(0, 11, {2, 37}, at::kLong), at::randn({2, 37, 6}, at::kDouble),
          at::randn({2, 37, 6}, at::kDouble), at::randn({2, 37, 11}, at::kDouble)};
}

// The weight's gradient after `passes` backward passes of the loss Σ rows * out_grad, plus,
// when `tied`, Σ (head_input @ weightᵀ) * head_grad; with `ours` through embedding_rows, else
// through ATen's embedding.
// `padding_row` (-1: none) gets no gradient from the lookup, as ATen's padding_idx gives none.
at::Tensor weight_grad(const Case& c, const at::TensorOptions& options, bool ours, bool tied, int passes = 1,
                       int64_t padding_row = -1) {
  auto weight = c.weight.to(options, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true);
  for (int pass = 0; pass < passes; ++pass) {
    const auto ids = c.ids.to(options.device());
    const auto rows = ours ? embedding_rows(weight, ids, padding_row) : at::embedding(weight, ids, padding_row);
    auto loss = (rows * c.out_grad.to(options)).sum();
    if (tied) loss = loss + (at::linear(c.head_input.to(options), weight) * c.head_grad.to(options)).sum();
    loss.backward();
  }
  return weight.grad();
}

}  // namespace

TEST_CASE("the embedding's backward adds into weight.grad what autograd would", "[models]") {
  const Case c = make_case();
  for (const bool tied : {false, true}) {
    for (const int passes : {1, 2}) {
      INFO("tied " << tied << ", passes " << passes);
      const auto options = at::TensorOptions(at::kDouble);
      CHECK(torch::allclose(weight_grad(c, options, true, tied, passes), weight_grad(c, options, false, tied, passes),
                            1e-13, 1e-13));
      // In float32, each token's rows are summed in their order, as ATen's host backward sums them.
      const auto f32 = at::TensorOptions(at::kFloat);
      CHECK(at::equal(weight_grad(c, f32, true, false, passes), weight_grad(c, f32, false, false, passes)));
      // A padding row: none of the lookup's gradient, all of a tied head's.
      const int64_t pad = c.ids[0][0].item<int64_t>();
      const auto padded = weight_grad(c, options, true, tied, passes, pad);
      CHECK(torch::allclose(padded, weight_grad(c, options, false, tied, passes, pad), 1e-13, 1e-13));
      if (!tied) CHECK(padded[pad].abs().sum().item<double>() == 0.0);
    }
  }
  // bf16 rows summed in float32 and rounded once: within bf16's rounding of the float64 sum.
  const auto bf16 = weight_grad(c, at::TensorOptions(at::kBFloat16), true, false).to(at::kDouble);
  CHECK(relative_error(bf16, weight_grad(c, at::TensorOptions(at::kDouble), false, false)) < std::ldexp(1.0, -7));

  // A frozen weight gets no gradient, and a lookup without gradients is a plain one.
  const auto frozen = c.weight.clone();
  CHECK(!embedding_rows(frozen, c.ids).requires_grad());
  auto trained = c.weight.clone().requires_grad_(true);
  {
    at::NoGradGuard no_grad;
    CHECK(!embedding_rows(trained, c.ids).requires_grad());
  }
  CHECK(at::equal(embedding_rows(trained, c.ids), at::embedding(c.weight, c.ids)));
}

TEST_CASE("one token, distinct tokens, and row 0 beside the zero sums that pad the distinct ones", "[models]") {
  at::manual_seed(3);
  const auto weight = at::randn({11, 6}, at::kDouble);
  // Sums come for as many tokens as the batch has, the distinct ones first and zeros added to
  // row 0 after: row 0's own gradient must be its rows' sum whether it came first, last or not.
  const std::vector<at::Tensor> batches = {at::full({1, 1}, 4, at::kLong), at::arange(11, at::kLong).view({1, 11}),
                                           at::tensor({0, 0, 5, 0, 5, 9}, at::kLong).view({2, 3}),
                                           at::tensor({7, 3, 3, 10}, at::kLong).view({1, 4})};
  for (const auto& ids : batches) {
    INFO("ids " << ids);
    const auto out_grad = at::randn({ids.size(0), ids.size(1), 6}, at::kDouble);
    for (const int64_t padding_row : {-1, 0}) {
      auto ours = weight.clone().requires_grad_(true);
      (embedding_rows(ours, ids, padding_row) * out_grad).sum().backward();
      auto reference = weight.clone().requires_grad_(true);
      (at::embedding(reference, ids, padding_row) * out_grad).sum().backward();
      CHECK(at::equal(ours.grad(), reference.grad()));
    }
  }
}

TEST_CASE("on a GPU the embedding's gradient is the same bits run after run", "[models][gpu]") {
  if (!gpu_half_runs()) return;
  const Case c = make_case();
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    INFO("dtype " << dtype);
    const auto options = at::TensorOptions(dtype).device(at::kCUDA);
    const auto first = weight_grad(c, options, true, true, 2);
    CHECK(at::equal(first, weight_grad(c, options, true, true, 2)));
    const auto reference = weight_grad(c, at::TensorOptions(at::kDouble), false, true, 2);
    CHECK(relative_error(first.cpu().to(at::kDouble), reference) < kernel_bound(dtype) * 4);
  }
}

#ifdef FSDPP_TESTS_SEE_DEVICE_WAITS
TEST_CASE("on a GPU the embedding's backward never waits for the device", "[models][gpu]") {
  if (!gpu_half_runs()) return;
  const Case c = make_case();
  const auto options = at::TensorOptions(at::kBFloat16).device(at::kCUDA);
  auto weight = c.weight.to(options).requires_grad_(true);
  const auto ids = c.ids.to(at::kCUDA);
  const auto out_grad = c.out_grad.to(options);
  {
    DeviceWaitsRaise raise;
    (embedding_rows(weight, ids) * out_grad).sum().backward();
  }
  const auto reference = weight_grad(c, at::TensorOptions(at::kDouble), false, false);
  CHECK(relative_error(weight.grad().cpu().to(at::kDouble), reference) < kernel_bound(at::kBFloat16) * 4);
}
#endif
