// AdamW with clipping decided on the device: the clip's divisor applied inside the fused
// kernel, checked against AdamW's first step written out in float64, and a step whose norm
// is not finite skipped without the host reading the norm; and updates left to a host thread,
// bitwise those of the step, with their errors reaching the caller; gradient norms known in
// advance taken as they are.
#include "optim/adamw.h"

#include "tensor_checks.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

using namespace fsdpp;

namespace {

const OptimizerConfig kAdamW{.lr = 1e-2, .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};

// Two matrices and a vector, each with a gradient `gradient_size` times a fixed pattern.
std::vector<at::Tensor> parameters(const at::TensorOptions& options, double gradient_size) {
  std::vector<at::Tensor> params;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{5, 7}, {3, 4}, {6}}) {
    const auto n = static_cast<double>(params.size() + 1);
    int64_t numel = 1;
    for (const int64_t size : shape) numel *= size;
    auto p = (at::arange(numel, options) * 0.37 * n).sin().view(shape);
    p.requires_grad_(true);
    p.mutable_grad() = (at::arange(p.numel(), options) * 0.91 + n).cos().view(shape) * gradient_size;
    params.push_back(p);
  }
  return params;
}

// Copies with their own gradients, for a second optimizer.
std::vector<at::Tensor> copies(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) {
    auto c = p.detach().clone().requires_grad_(true);
    c.mutable_grad() = p.grad().clone();
    out.push_back(c);
  }
  return out;
}

// AdamW's first step from `before` (float64), its gradient divided by `divisor` first.
at::Tensor first_step(const at::Tensor& before, const at::Tensor& grad, double divisor) {
  const auto g = grad.to(at::kDouble) / divisor;
  const auto m = (1 - kAdamW.beta1) * g;
  const auto v = (1 - kAdamW.beta2) * g * g;
  const auto p = before.to(at::kDouble) * (1 - kAdamW.lr * kAdamW.weight_decay);
  return p - kAdamW.lr * (m / (1 - kAdamW.beta1)) / ((v / (1 - kAdamW.beta2)).sqrt() + kAdamW.eps);
}

// Clipping at `max_norm` takes the first step of the float64 formula, and the first moment
// holds the divided gradient, within 64 roundings of the parameters' dtype.
void check_clipped_step(const at::TensorOptions& options) {
  auto params = parameters(options, 3.0);
  std::vector<at::Tensor> before, grads;
  double squares = 0.0;
  for (const auto& p : params) {
    before.push_back(p.detach().clone());
    grads.push_back(p.grad().clone());
    squares += p.grad().to(at::kDouble).pow(2).sum().item<double>();
  }
  const double max_norm = 0.5, norm = std::sqrt(squares);
  REQUIRE(norm > 4 * max_norm);  // the clip takes effect
  const GradClip clip = clip_by_norm({{.params = params}}, max_norm);
  const double epsilon = params.front().scalar_type() == at::kDouble ? std::numeric_limits<double>::epsilon()
                                                                     : std::numeric_limits<float>::epsilon();
  CHECK(clip.norm.item<double>() == Approx(norm).epsilon(64 * epsilon));
  CHECK(clip.non_finite.item<float>() == 0);
  // The divisor is float32 whatever the parameters' dtype.
  const double divisor = clip.divisor.item<float>();
  CHECK(divisor == Approx((norm + 1e-6) / max_norm).epsilon(64 * std::numeric_limits<float>::epsilon()));
  AdamW optimizer({{"decay", params, kAdamW.weight_decay}}, kAdamW);
  optimizer.step(kAdamW.lr, clip);
  for (size_t i = 0; i < params.size(); ++i) {
    INFO("parameter " << i);
    CHECK(relative_error(params[i].detach().to(at::kDouble), first_step(before[i], grads[i], divisor)) < 64 * epsilon);
    // Adam's first step hardly depends on the gradient's size; its first moment is linear in it.
    const auto state = *optimizer.state_of(params[i]);
    const auto first_moment = (1 - kAdamW.beta1) * grads[i].to(at::kDouble) / divisor;
    CHECK(relative_error(state.exp_avg.to(at::kDouble), first_moment) < 64 * epsilon);  // both on the device
    CHECK(state.step.item<float>() == 1);
  }
}

// A gradient of inf or nan leaves every parameter, moment and step count as it was; the next
// finite step is then the optimizer's first.
void check_skipped_step(const at::TensorOptions& options, double max_norm, double bad_value) {
  auto params = parameters(options, 1.0);
  auto reference = copies(params);
  const auto good = params[1].grad().clone();
  params[1].mutable_grad()[2][3] = bad_value;
  AdamW optimizer({{"decay", params, kAdamW.weight_decay}}, kAdamW);
  const GradClip clip = clip_by_norm({{.params = params}}, max_norm);
  CHECK(clip.non_finite.item<float>() == 1);
  optimizer.step(kAdamW.lr, clip);
  for (size_t i = 0; i < params.size(); ++i) {
    INFO("parameter " << i);
    CHECK(at::equal(params[i].detach(), reference[i].detach()));
    const auto state = *optimizer.state_of(params[i]);
    CHECK(state.step.item<float>() == 0);
    CHECK(state.exp_avg.abs().max().item<double>() == 0);
    CHECK(state.exp_avg_sq.abs().max().item<double>() == 0);
  }
  params[1].mutable_grad() = good;
  optimizer.step(kAdamW.lr, clip_by_norm({{.params = params}}, max_norm));
  AdamW fresh({{"decay", reference, kAdamW.weight_decay}}, kAdamW);
  fresh.step(kAdamW.lr, clip_by_norm({{.params = reference}}, max_norm));
  for (size_t i = 0; i < params.size(); ++i) {
    INFO("parameter " << i << " after a finite step");
    CHECK(at::equal(params[i].detach(), reference[i].detach()));
    CHECK(optimizer.state_of(params[i])->step.item<float>() == 1);
  }
}

}  // namespace

TEST_CASE("clipping divides the gradients inside AdamW's update", "[train]") {
  const auto dtype = GENERATE(at::kDouble, at::kFloat);
  INFO("dtype " << dtype);
  check_clipped_step(at::TensorOptions(dtype));
}

TEST_CASE("a norm under the limit leaves the gradients as they are", "[train]") {
  auto params = parameters(at::TensorOptions(at::kFloat), 1.0);
  auto unclipped = copies(params);
  const GradClip clip = clip_by_norm({{.params = params}}, 1e3);
  CHECK(clip.divisor.item<float>() == 1);
  AdamW({{"decay", params, kAdamW.weight_decay}}, kAdamW).step(kAdamW.lr, clip);
  AdamW({{"decay", unclipped, kAdamW.weight_decay}}, kAdamW).step(kAdamW.lr);
  for (size_t i = 0; i < params.size(); ++i) CHECK(at::equal(params[i].detach(), unclipped[i].detach()));
}

TEST_CASE("a step whose gradient norm is not finite changes nothing and is not counted", "[train]") {
  const double max_norm = GENERATE(0.0, 1.0);  // clipping off or on
  const double bad = GENERATE(std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN());
  INFO("max_norm " << max_norm << ", gradient " << bad);
  check_skipped_step(at::TensorOptions(at::kFloat), max_norm, bad);
}

TEST_CASE("clipping and skipping run on the GPU as on the host", "[train][gpu]") {
  if (!gpu_half_runs()) return;
  const auto cuda = at::TensorOptions(at::kFloat).device(at::kCUDA);
  check_clipped_step(cuda);
  check_skipped_step(cuda, 1.0, std::numeric_limits<double>::quiet_NaN());
}

TEST_CASE("updates left to a host thread equal those in the step, batch by batch", "[train]") {
  auto params = parameters(at::TensorOptions(at::kFloat), 3.0);
  auto later = copies(params);
  AdamW now({{"decay", {params[0], params[1]}, kAdamW.weight_decay}, {"no_decay", {params[2]}, 0.0}}, kAdamW);
  AdamW deferred({{"decay", {later[0], later[1]}, kAdamW.weight_decay}, {"no_decay", {later[2]}, 0.0}}, kAdamW);
  for (int step = 0; step < 2; ++step) {
    INFO("step " << step);
    now.step(kAdamW.lr, clip_by_norm({{.params = params}}, 0.5));
    // Batches across both groups, in an order of their own; a step waits for the previous one's.
    const auto done =
        deferred.step(kAdamW.lr, clip_by_norm({{.params = later}}, 0.5), {{later[2], later[0]}, {later[1]}});
    REQUIRE(done.size() == 2);
    done[0].get();
    for (const size_t i : {0, 2}) CHECK(at::equal(later[i].detach(), params[i].detach()));
    done[1].get();
    for (size_t i = 0; i < params.size(); ++i) {
      INFO("parameter " << i);
      CHECK(at::equal(later[i].detach(), params[i].detach()));
      const auto a = *now.state_of(params[i]), b = *deferred.state_of(later[i]);
      CHECK(at::equal(a.exp_avg, b.exp_avg));
      CHECK(at::equal(a.exp_avg_sq, b.exp_avg_sq));
      CHECK(b.step.item<float>() == step + 1);
    }
  }
}

TEST_CASE("a host thread's failed update reaches its future, the ones after it, and settle", "[train]") {
  auto params = parameters(at::TensorOptions(at::kFloat), 1.0);
  AdamW optimizer({{"decay", params, kAdamW.weight_decay}}, kAdamW);
  params[1].mutable_grad() = params[1].grad().to(at::kDouble);  // the fused kernel refuses the mix
  const auto done = optimizer.step(kAdamW.lr, {}, {{params[0]}, {params[1]}, {params[2]}});
  REQUIRE(done.size() == 3);
  CHECK_NOTHROW(done[0].get());
  CHECK_THROWS_WITH(done[1].get(), Catch::Contains("expected scalar type Float but found Double"));
  CHECK_THROWS(done[2].get());
  CHECK_THROWS(optimizer.settle());
}

TEST_CASE("clipping takes a gradient's norm taken as it was made, and the rest from the gradients", "[train]") {
  auto params = parameters(at::TensorOptions(at::kFloat), 3.0);
  const GradClip read = clip_by_norm({{.params = params}}, 0.5);
  // The norms the clip takes itself, given: bitwise the same clip.
  std::vector<at::Tensor> grads;
  for (const auto& p : params) grads.push_back(p.grad());
  const std::vector<at::Tensor> norms = at::_foreach_norm(grads, 2);
  const GradClip given = clip_by_norm({{.params = params, .grad_norms = norms}}, 0.5);
  CHECK(at::equal(given.norm, read.norm));
  CHECK(at::equal(given.divisor, read.divisor));
  // One of them known as twice its gradient's norm, one unknown: the sum takes the known one.
  const double n0 = norms[0].item<double>(), n1 = norms[1].item<double>(), n2 = norms[2].item<double>();
  const GradClip mixed = clip_by_norm({{.params = params, .grad_norms = {norms[0] * 2, at::Tensor(), norms[2]}}}, 0.5);
  CHECK(mixed.norm.item<double>() == Approx(std::sqrt(4 * n0 * n0 + n1 * n1 + n2 * n2)).epsilon(1e-6));
  CHECK(read.norm.item<double>() == Approx(std::sqrt(n0 * n0 + n1 * n1 + n2 * n2)).epsilon(1e-6));
}
