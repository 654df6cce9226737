// The residual add and RMSNorm: on the host an add and the norm's own call; on a GPU one fused
// kernel each way, against the same steps in float64 (the sum rounded to the element type, as
// the kernel and an unfused add leave it), values and the gradients of x, delta and the
// weight, in float32, bf16 and fp16, from aligned and unaligned memory, in packs and element
// by element over more rows than the backward has blocks, with and without a gradient reaching
// the sum besides the norm's. A norm with a hook of its own keeps its call.
#include "models/residual_norm.h"

#include "tensor_checks.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

using namespace fsdpp;

namespace {

constexpr double kEps = 1e-6;

// What a test feeds the two paths: inputs as rounded to the element type, in float64.
struct Inputs {
  at::Tensor x, delta, weight;   // [R, C], [R, C], [C]
  at::Tensor sum_weights, normed_weights;  // [R, C]: the loss is Σ sum * sum_weights + normed * normed_weights
  bool sum_read = true;  // false: the loss reads the norm alone, and the sum gets no gradient of its own
};

at::Tensor loss(const Inputs& in, const at::Tensor& sum, const at::Tensor& normed) {
  const auto from_norm = (normed * in.normed_weights.to(normed.options())).sum();
  return in.sum_read ? from_norm + (sum * in.sum_weights.to(sum.options())).sum() : from_norm;
}

Inputs make_inputs(int64_t rows, int64_t width, at::ScalarType dtype) {
  const auto rounded = [&](at::Tensor t) { return t.to(dtype).to(at::kDouble); };
  return {rounded(at::randn({rows, width}, at::kDouble)), rounded(at::randn({rows, width}, at::kDouble)),
          rounded(at::rand({width}, at::kDouble) + 0.5), rounded(at::randn({rows, width}, at::kDouble)),
          rounded(at::randn({rows, width}, at::kDouble))};
}

struct NormOutcome {
  at::Tensor sum, normed;      // float64 on the host
  at::Tensor grad_x, grad_delta, grad_weight;
};

// `values` copied into memory of `options` that starts one element past a 16-byte boundary
// when `unaligned` (so the kernels go element by element).
at::Tensor placed(const at::Tensor& values, const at::TensorOptions& options, bool unaligned) {
  if (!unaligned) return values.to(options, /*non_blocking=*/false, /*copy=*/true);
  auto block = at::empty({values.numel() + 1}, options).narrow(0, 1, values.numel());
  return block.view(values.sizes()).copy_(values);
}

// Runs `norm` after the add on copies of the inputs in `options`, x unaligned if asked; the
// weight trains unless `frozen`. `normed` receives the norm's output.
NormOutcome run(RMSNorm& norm, const Inputs& in, const at::TensorOptions& options, bool unaligned, bool frozen,
            at::Tensor* normed_out = nullptr) {
  auto x = placed(in.x, options, unaligned).requires_grad_(true);
  auto delta = in.delta.to(options, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true);
  {
    at::NoGradGuard no_grad;
    norm.weight.copy_(in.weight);
  }
  norm.weight.requires_grad_(!frozen);
  norm.weight.mutable_grad() = at::Tensor();
  const auto [sum, normed] = add_then_norm(x, delta, norm);
  if (normed_out != nullptr) *normed_out = normed;
  loss(in, sum, normed).backward();
  const auto host = [](const at::Tensor& t) { return t.defined() ? t.to(at::kCPU, at::kDouble) : t; };
  return {host(sum.detach()), host(normed.detach()), host(x.grad()), host(delta.grad()), host(norm.weight.grad())};
}

// The same steps in float64, the sum rounded to `dtype` in value but not in gradient.
NormOutcome reference(const Inputs& in, at::ScalarType dtype) {
  auto x = in.x.clone().requires_grad_(true), delta = in.delta.clone().requires_grad_(true);
  auto weight = in.weight.clone().requires_grad_(true);
  auto exact = x + delta;
  const auto sum = exact + (exact.to(dtype).to(at::kDouble) - exact).detach();
  const auto normed = weight * sum * at::rsqrt(sum.square().mean(-1, /*keepdim=*/true) + kEps);
  loss(in, sum, normed).backward();
  return {sum.detach(), normed.detach(), x.grad(), delta.grad(), weight.grad()};
}

void check_close(const NormOutcome& actual, const NormOutcome& expected, double bound) {
  CHECK(relative_error(actual.sum, expected.sum) < bound);
  CHECK(relative_error(actual.normed, expected.normed) < bound);
  CHECK(relative_error(actual.grad_x, expected.grad_x) < bound);
  CHECK(relative_error(actual.grad_delta, expected.grad_delta) < bound);
  if (actual.grad_weight.defined()) CHECK(relative_error(actual.grad_weight, expected.grad_weight) < bound);
}

}  // namespace

TEST_CASE("the residual add and RMSNorm on the host are an add and the norm's call", "[models]") {
  at::manual_seed(3);
  RMSNorm norm("LlamaRMSNorm", 24, kEps, at::TensorOptions(at::kDouble));
  const auto in = make_inputs(5, 24, at::kDouble);
  int calls = 0;
  norm.add_post_forward_hook([&](Module&, torch::Tensor&) { ++calls; });
  const NormOutcome actual = run(norm, in, at::TensorOptions(at::kDouble), /*unaligned=*/false, /*frozen=*/false);
  CHECK(calls == 1);
  check_close(actual, reference(in, at::kDouble), 1e-12);
}

TEST_CASE("the fused residual RMSNorm kernel gives the add, the norm and their gradients", "[models][gpu]") {
  if (!gpu_half_runs()) return;
  const auto dtype = GENERATE(at::kFloat, at::kBFloat16, at::kHalf);
  const bool unaligned = GENERATE(false, true);
  // Narrow rows; rows of whole packs and rows of single elements, more of them than the
  // backward's blocks on any GPU (four per multiprocessor).
  const auto [rows, width] = GENERATE(std::pair<int64_t, int64_t>{7, 37}, std::pair<int64_t, int64_t>{1500, 2048},
                                      std::pair<int64_t, int64_t>{1500, 2050});
  const bool frozen = GENERATE(false, true);
  const bool sum_read = GENERATE(true, false);
  INFO(dtype << (unaligned ? ", unaligned" : "") << ", " << rows << " x " << width << (frozen ? ", frozen weight" : "")
             << (sum_read ? "" : ", the sum read by the norm alone"));
  at::manual_seed(9);
  auto in = make_inputs(rows, width, dtype);
  in.sum_read = sum_read;
  const auto options = at::TensorOptions(dtype).device(at::kCUDA);
  RMSNorm norm("LlamaRMSNorm", width, kEps, options);
  at::Tensor normed;
  const NormOutcome actual = run(norm, in, options, unaligned, frozen, &normed);
  const NormOutcome expected = reference(in, dtype);
  CHECK(backward_runs(normed, "FusedAddRMSNorm"));
  CHECK(actual.grad_weight.defined() == !frozen);
  check_close(actual, expected, kernel_bound(dtype));

  // With a hook the norm is called as a module: the add and ATen's norm.
  int calls = 0;
  norm.add_pre_forward_hook([&](Module&, Module::Tensors&) { ++calls; });
  const NormOutcome hooked = run(norm, in, options, unaligned, frozen, &normed);
  CHECK(calls == 1);
  CHECK_FALSE(backward_runs(normed, "FusedAddRMSNorm"));
  check_close(hooked, expected, kernel_bound(dtype));
}
