// SwiGLU and RoPE: the composed ops against transformers' formulas on the host, and the fused
// CUDA kernels against those formulas in float64, values and gradients, in float32 and bf16,
// from aligned and unaligned memory, with shared and per-sequence tables (float32, or cast to
// the compute dtype as a unit casts its inputs) and q laid out as its projection leaves it.
#include "models/elementwise.h"

#include "tensor_checks.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include <functional>

using namespace fsdpp;

namespace {

// transformers' rotation as written there: x * cos + rotate_half(x) * sin.
at::Tensor rotate_half_reference(const at::Tensor& x, const at::Tensor& cos_sin) {
  auto cos = cos_sin[0], sin = cos_sin[1];
  if (cos.dim() == 3 && x.dim() == 4) {
    cos = cos.unsqueeze(1);
    sin = sin.unsqueeze(1);
  }
  const int64_t half = x.size(-1) / 2;
  const auto rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

// `f` and the gradients of sum(f(inputs) * weights) with respect to every input.
struct Outcome {
  at::Tensor out;
  std::vector<at::Tensor> grads;
};
Outcome run(const std::function<at::Tensor(const std::vector<at::Tensor>&)>& f, std::vector<at::Tensor> inputs,
            const at::Tensor& weights) {
  for (auto& x : inputs) x.requires_grad_(true);
  Outcome o{f(inputs), {}};
  (o.out * weights.to(o.out.options())).sum().backward();
  for (const auto& x : inputs) o.grads.push_back(x.grad());
  return o;
}

// `values` copied into GPU memory of `dtype` that starts one element past a 16-byte boundary
// when `unaligned` (so the kernels take their element-by-element path).
at::Tensor on_gpu(const at::Tensor& values, at::ScalarType dtype, bool unaligned) {
  const auto options = at::TensorOptions(dtype).device(at::kCUDA);
  if (!unaligned) return values.to(options);
  auto block = at::empty({values.numel() + 1}, options).narrow(0, 1, values.numel());
  return block.view(values.sizes()).copy_(values);
}

void check_close(const Outcome& actual, const Outcome& expected, at::ScalarType dtype) {
  CHECK(relative_error(actual.out.to(at::kCPU, at::kDouble), expected.out) < kernel_bound(dtype));
  for (size_t i = 0; i < expected.grads.size(); ++i) {
    INFO("gradient of input " << i);
    CHECK(relative_error(actual.grads[i].to(at::kCPU, at::kDouble), expected.grads[i]) < kernel_bound(dtype));
  }
}

}  // namespace

TEST_CASE("the composed RoPE is transformers' rotate_half", "[models]") {
  at::manual_seed(3);
  const auto x = at::randn({2, 3, 5, 8}, at::kDouble);  // [B, H, T, D]
  for (const auto& tables : {at::randn({2, 5, 8}, at::kDouble), at::randn({2, 2, 5, 8}, at::kDouble)}) {
    INFO("tables " << tables.sizes());
    CHECK(relative_error(apply_rotary(x, tables), rotate_half_reference(x, tables)) < 1e-12);
  }
  const auto vision = at::randn({3, 5, 8}, at::kDouble);  // [H, N, D]
  const auto vision_tables = at::randn({2, 5, 8}, at::kDouble);
  CHECK(relative_error(apply_rotary(vision, vision_tables), rotate_half_reference(vision, vision_tables)) < 1e-12);
}

TEST_CASE("SwiGLU from one joint product of gate and up is SwiGLU of its halves", "[models]") {
  at::manual_seed(4);
  const auto gate_up = at::randn({2, 5, 12}, at::kDouble);  // [B, T, 2I]
  const auto dy = at::randn({2, 5, 6}, at::kDouble);
  auto joined = gate_up.clone().requires_grad_(true);
  auto gate = gate_up.narrow(-1, 0, 6).clone().requires_grad_(true), up = gate_up.narrow(-1, 6, 6).clone().requires_grad_(true);
  const auto out = swiglu_joined(joined);
  const auto expected = swiglu(gate, up);
  // The same ATen ops, on strided halves where the reference's are contiguous (another of the
  // host's kernels, so rounding alone may differ).
  CHECK(relative_error(out, expected) < 1e-14);
  CHECK(backward_runs(out, "JoinedSwiGLU"));
  out.backward(dy);
  expected.backward(dy);
  CHECK(joined.grad().is_contiguous());
  CHECK(relative_error(joined.grad(), at::cat({gate.grad(), up.grad()}, -1)) < 1e-14);
}

TEST_CASE("the fused SwiGLU kernel gives silu(gate) * up and its gradients", "[models][gpu]") {
  if (!gpu_half_runs()) return;
  const auto dtype = GENERATE(at::kFloat, at::kBFloat16, at::kHalf);
  const bool unaligned = GENERATE(false, true);
  // Within one block of threads; many blocks, the last pack ragged.
  const auto shape = GENERATE(std::vector<int64_t>{3, 37}, std::vector<int64_t>{3, 1531});
  INFO(dtype << (unaligned ? ", unaligned" : "") << ", shape " << at::IntArrayRef(shape));
  at::manual_seed(5);
  // The reference starts from the inputs as rounded to dtype.
  const auto gate = at::randn(shape, at::kDouble).mul(3).to(dtype).to(at::kDouble);
  const auto up = at::randn(shape, at::kDouble).to(dtype).to(at::kDouble);
  const auto weights = at::randn(shape, at::kDouble).to(dtype).to(at::kDouble);
  auto composed = [](const std::vector<at::Tensor>& in) { return at::silu(in[0]) * in[1]; };
  auto fused = [](const std::vector<at::Tensor>& in) { return swiglu(in[0], in[1]); };
  const auto expected = run(composed, {gate.clone(), up.clone()}, weights);
  const auto actual = run(fused, {on_gpu(gate, dtype, unaligned), on_gpu(up, dtype, unaligned)}, weights.cuda());
  check_close(actual, expected, dtype);
  CHECK(backward_runs(actual.out, "FusedSwiGLU"));
}

TEST_CASE("the fused SwiGLU kernel reads gate and up as the halves of a joint product's rows", "[models][gpu]") {
  if (!gpu_half_runs()) return;
  const auto dtype = GENERATE(at::kFloat, at::kBFloat16, at::kHalf);
  // Halves of whole packs, and of ragged ones (I = 37: the up half starts off a pack).
  const int64_t width = GENERATE(64, 37);
  INFO(dtype << ", I = " << width);
  at::manual_seed(6);
  const auto gate_up = (at::randn({3, 70, 2 * width}, at::kDouble) * 2).to(dtype).to(at::kDouble);  // [B, T, 2I]
  const auto weights = at::randn({3, 70, width}, at::kDouble).to(dtype).to(at::kDouble);
  auto composed = [&](const std::vector<at::Tensor>& in) {
    return at::silu(in[0].narrow(-1, 0, width)) * in[0].narrow(-1, width, width);
  };
  auto fused = [](const std::vector<at::Tensor>& in) { return swiglu_joined(in[0]); };
  const auto expected = run(composed, {gate_up.clone()}, weights);
  const auto actual = run(fused, {gate_up.to(at::TensorOptions(dtype).device(at::kCUDA))}, weights.cuda());
  check_close(actual, expected, dtype);
  CHECK(backward_runs(actual.out, "FusedJoinedSwiGLU"));
}

TEST_CASE("the fused RoPE kernel gives transformers' rotation and its gradient", "[models][gpu]") {
  if (!gpu_half_runs()) return;
  const auto dtype = GENERATE(at::kFloat, at::kBFloat16, at::kHalf);
  const bool per_sequence = GENERATE(false, true);
  const std::string layout = GENERATE("projected", "contiguous", "narrowed");
  // float32 tables, or tables in the compute dtype, as a unit's cast of its inputs leaves them.
  const bool tables_cast = GENERATE(false, true);
  INFO(dtype << (per_sequence ? ", per-sequence tables" : ", shared tables") << (tables_cast ? " (cast)" : "") << ", "
             << layout << " x");
  at::manual_seed(7);
  const int64_t B = 2, H = 5, T = 37, D = 64;  // 5,920 pairs: many blocks of threads
  // Tables of independent values, so a kernel mixing up the halves' entries shows.
  const auto tables = per_sequence ? at::randn({2, B, T, D}, at::kFloat) : at::randn({2, T, D}, at::kFloat);
  const auto values = at::randn({B, H, T, D}, at::kDouble).to(dtype).to(at::kDouble);
  const auto weights = at::randn({B, H, T, D}, at::kDouble).to(dtype).to(at::kDouble);
  const auto x_on_gpu = [&]() -> at::Tensor {
    const auto options = at::TensorOptions(dtype).device(at::kCUDA);
    if (layout == "projected") {  // [B, T, H, D] in memory, viewed as [B, H, T, D]
      return values.transpose(1, 2).contiguous().to(options).transpose(1, 2);
    }
    if (layout == "narrowed") {  // the rotated part of a wider head, as latent attention takes it
      auto wide = at::zeros({B, H, T, D + 4}, options);
      return wide.narrow(-1, 4, D).copy_(values);
    }
    return values.to(options);
  }();
  const auto cpu_tables = tables.to(dtype).to(at::kDouble);  // rounded as transformers rounds them
  auto composed = [&](const std::vector<at::Tensor>& in) { return rotate_half_reference(in[0], cpu_tables); };
  const auto gpu_tables = tables.to(at::TensorOptions(tables_cast ? dtype : at::kFloat).device(at::kCUDA));
  auto fused = [&](const std::vector<at::Tensor>& in) { return apply_rotary(in[0], gpu_tables); };
  const auto expected = run(composed, {values.clone()}, weights);
  const auto actual = run(fused, {x_on_gpu.detach()}, weights.cuda());
  check_close(actual, expected, dtype);
  CHECK(backward_runs(actual.out, "FusedRotary"));
}
