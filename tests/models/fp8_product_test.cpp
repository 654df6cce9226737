// Float8 products. On the host: rowwise scaling by powers of two, checked against e4m3's own
// rounding bound, and the refusal of a device without FP8 matrix units. On a GPU: the fused
// scaling kernel against the host's bits, each product against float64 products of the same
// scaled operands (also over a 1B model's widths as a whole), the Linear's autograd against its
// two products and bf16's weight gradient, and a joint q/k/v product against separate ones.
#include "models/fp8_product.h"

#include "models/joint_projection.h"
#include "models/layers.h"
#include "tensor_checks.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>

using namespace fsdpp;

namespace {

// The rows as the product sees them, in float64: values times their factors.
at::Tensor restored(const Fp8Rows& rows) { return rows.values.to(at::kDouble) * rows.inverse.to(at::kDouble); }

// How far a float8 product may be from float64's product of the same scaled operands a
// [M, inner] and b [inner, N]: the bf16 rounding of the result, plus accumulation error
// bounded by 2^-8 of Σ|a||b| (the tensor cores' fast accumulation keeps fewer bits than
// float32).
void check_product(const at::Tensor& actual, const at::Tensor& a, const at::Tensor& b) {
  const auto expected = a.mm(b);
  const auto bound = expected.abs() * std::ldexp(1.0, -8) + a.abs().mm(b.abs()) * std::ldexp(1.0, -8);
  const auto excess = (actual.to(at::kDouble).cpu() - expected.cpu()).abs() - bound.cpu();
  CHECK(excess.max().item<double>() <= 0);
}

}  // namespace

TEST_CASE("rows scale by a power of two into e4m3's range and round once", "[models]") {
  at::manual_seed(3);
  // Rows spanning 2^-40 to 2^40, a row of zeros, and a row holding inf.
  const auto magnitudes = at::exp2(at::linspace(-40, 40, 30, at::kDouble)).unsqueeze(1);
  auto x = (at::randn({32, 96}, at::kDouble) * at::cat({magnitudes, at::ones({2, 1}, at::kDouble)})).to(at::kFloat);
  x[30].zero_();
  x[31][5] = std::numeric_limits<float>::infinity();
  const Fp8Rows q = quantize_rows(x);
  REQUIRE(q.values.scalar_type() == at::kFloat8_e4m3fn);
  REQUIRE(q.values.sizes() == x.sizes());
  REQUIRE(q.inverse.sizes() == at::IntArrayRef{32, 1});

  const auto scale = q.inverse.to(at::kDouble).reciprocal().narrow(0, 0, 30);   // [30, 1]
  const auto x64 = x.to(at::kDouble).narrow(0, 0, 30);
  // Powers of two, the largest that keep each row within ±448: its largest element lands in
  // (224, 448].
  const auto exponents = at::log2(scale);
  CHECK(at::equal(exponents, at::round(exponents)));
  const auto top = x64.abs().amax(1, true) * scale;
  CHECK(top.max().item<double>() <= kE4m3Max);
  CHECK(top.min().item<double>() > kE4m3Max / 2);
  // Scaling by a power of two is exact, so the one error is e4m3's rounding: half a step, 2^-4
  // of the value among normals, 2^-10 among subnormals (below 2^-6), in the scaled units.
  const auto scaled = x64 * scale;
  const auto error = (q.values.narrow(0, 0, 30).to(at::kDouble) - scaled).abs();
  const auto bound = at::maximum(scaled.abs() * std::ldexp(1.0, -4), at::full_like(scaled, std::ldexp(1.0, -10)));
  CHECK((error - bound).max().item<double>() <= 0);
  // A row of zeros restores to zeros; a row with inf to non-finite values.
  CHECK(restored(q)[30].abs().max().item<double>() == 0.0);
  CHECK(!restored(q)[31].isfinite().all().item<bool>());

  // Values e4m3 holds exactly come back exactly, and a bf16 input scales as its float32 twin.
  const auto exact = (at::randint(-15, 16, {4, 32}, at::kDouble) / 8 * std::ldexp(1.0, 10)).to(at::kBFloat16);
  CHECK(at::equal(restored(quantize_rows(exact)), exact.to(at::kDouble)));
  const Fp8Rows from_bf16 = quantize_rows(exact);
  const Fp8Rows from_float = quantize_rows(exact.to(at::kFloat));
  CHECK(at::equal(from_bf16.values.to(at::kFloat), from_float.values.to(at::kFloat)));
  CHECK(at::equal(from_bf16.inverse, from_float.inverse));
}

TEST_CASE("the host runs no float8 products; a weight fits in multiples of 16", "[models]") {
  CHECK_FALSE(fp8_products_run(c10::Device(c10::kCPU)));
  CHECK(fp8_product_fits(at::empty({32, 48})));
  CHECK_FALSE(fp8_product_fits(at::empty({32, 40})));
  CHECK_FALSE(fp8_product_fits(at::empty({24, 48})));
}

TEST_CASE("the GPU's fused rowwise scaling gives the host's bits", "[models][gpu]") {
  if (!gpu_half_runs()) return;
  at::manual_seed(11);
  for (const auto dtype : {at::kBFloat16, at::kFloat, at::kHalf}) {
    for (const int64_t width : {1, 7, 300, 5000}) {
      INFO("dtype " << dtype << ", width " << width);
      // Rows from 2^-20 to 2^12 (fp16 holds them), and one of zeros.
      const auto magnitudes = at::exp2(at::linspace(-20, 12, 37, at::kDouble)).unsqueeze(1);
      auto x = (at::randn({37, width}, at::kDouble) * magnitudes).to(dtype);
      x[17].zero_();
      const Fp8Rows host = quantize_rows(x);
      const Fp8Rows gpu = quantize_rows(x.cuda());
      REQUIRE(gpu.values.is_cuda());
      CHECK(at::equal(gpu.values.cpu().view(at::kByte), host.values.view(at::kByte)));
      CHECK(at::equal(gpu.inverse.cpu(), host.inverse));
    }
  }
  // A row holding inf or nan restores to non-finite values there too.
  auto x = at::ones({2, 64}, at::TensorOptions(at::kBFloat16).device(at::kCUDA));
  x[0][3] = std::numeric_limits<float>::infinity();
  x[1][60] = std::numeric_limits<float>::quiet_NaN();
  const auto back = restored(quantize_rows(x)).cpu();
  CHECK(!back[0].isfinite().all().item<bool>());
  CHECK(!back[1].isfinite().all().item<bool>());
}

TEST_CASE("the GPU's fused columnwise scaling gives the host's bits, transposed", "[models][gpu]") {
  if (!gpu_half_runs()) return;
  at::manual_seed(13);
  for (const auto dtype : {at::kBFloat16, at::kFloat, at::kHalf}) {
    // Within one tile, and across ragged tiles both ways.
    for (const auto& shape : {std::vector<int64_t>{16, 48}, std::vector<int64_t>{300, 130}}) {
      INFO("dtype " << dtype << ", weight " << at::IntArrayRef(shape));
      // Columns from 2^-20 to 2^12, one of zeros, one holding inf and one nan.
      const auto magnitudes = at::exp2(at::linspace(-20, 12, shape[1], at::kDouble)).unsqueeze(0);
      auto weight = (at::randn(shape, at::kDouble) * magnitudes).to(dtype);
      weight.select(1, 5).zero_();
      weight[3][7] = std::numeric_limits<float>::infinity();
      weight[shape[0] - 1][9] = std::numeric_limits<float>::quiet_NaN();
      const Fp8Rows host = quantize_columns(weight);
      const Fp8Rows gpu = quantize_columns(weight.cuda());
      REQUIRE(gpu.values.is_cuda());
      CHECK(gpu.values.sizes() == weight.sizes());
      CHECK(gpu.values.t().is_contiguous());  // column-major, as _scaled_mm takes its right operand
      // The bits and factors of every finite column; the non-finite ones restore to non-finite
      // values.
      const auto finite = weight.isfinite().all(0).nonzero().squeeze(1);
      CHECK(at::equal(gpu.inverse.cpu().index_select(1, finite), host.inverse.index_select(1, finite)));
      const auto gpu_bits = gpu.values.t().cpu().view(at::kByte), host_bits = host.values.t().contiguous().view(at::kByte);
      CHECK(at::equal(gpu_bits.index_select(0, finite), host_bits.index_select(0, finite)));
      const auto back = restored(gpu).cpu();
      CHECK(!back[3][7].isfinite().item<bool>());
      CHECK(!back[shape[0] - 1][9].isfinite().item<bool>());
      // And the host's columns are the rows of the transpose.
      const Fp8Rows rows = quantize_rows(weight.t().contiguous());
      CHECK(at::equal(host.values.t().contiguous().view(at::kByte), rows.values.view(at::kByte)));
    }
  }
}

TEST_CASE("float8 products and the Linear's gradients on a GPU", "[models][gpu]") {
  if (!gpu_half_runs()) return;
  const c10::Device gpu(c10::kCUDA);
  INFO("float8 products need compute capability 9.0 or newer (the H100 and H200 of gpu_check)");
  REQUIRE(fp8_products_run(gpu));
  at::manual_seed(5);
  const auto bf16 = at::TensorOptions(at::kBFloat16).device(gpu);
  // 300 tokens (not a multiple of 16), 256 inputs, 128 outputs.
  const auto x = at::randn({2, 150, 256}, bf16);
  const auto weight = (at::randn({128, 256}, bf16) * 0.05).to(at::kBFloat16);
  const auto rows = x.reshape({300, 256});

  // The forward product: x and the weight each scaled per row.
  const auto out = fp8_forward_product(rows, weight);  // [300, 128]
  REQUIRE(out.scalar_type() == at::kBFloat16);
  check_product(out, restored(quantize_rows(rows)), restored(quantize_rows(weight)).t());
  // Within float8's rounding of the bf16 product: a few percent over the whole output.
  const auto exact = rows.to(at::kDouble).mm(weight.to(at::kDouble).t());
  CHECK((out.to(at::kDouble) - exact).norm().item<double>() < 0.08 * exact.norm().item<double>());

  // The input's gradient: the gradient scaled per row, the weight per column.
  const auto grad = at::randn({300, 128}, bf16);
  const auto grad_in = fp8_input_grad_product(grad, weight);  // [300, 256]
  check_product(grad_in, restored(quantize_rows(grad)), restored(quantize_rows(weight.t().contiguous())).t());
  const auto exact_in = grad.to(at::kDouble).mm(weight.to(at::kDouble));
  CHECK((grad_in.to(at::kDouble) - exact_in).norm().item<double>() < 0.08 * exact_in.norm().item<double>());

  // The Linear's autograd: its forward and input gradient are those two products; the weight's
  // gradient is bf16's.
  auto x_leaf = x.detach().requires_grad_(true);
  auto w_leaf = weight.detach().requires_grad_(true);
  const auto y = fp8_linear(x_leaf, w_leaf);  // [2, 150, 128]
  CHECK(backward_runs(y, "Fp8Linear"));
  y.backward(grad.view({2, 150, 128}));
  CHECK(at::equal(y.reshape({300, 128}), out));
  CHECK(at::equal(x_leaf.grad().reshape({300, 256}), grad_in));
  CHECK(at::equal(w_leaf.grad(), grad.t().mm(rows)));
}

TEST_CASE("float8 products at a 1B model's widths: e4m3's rounding alone, and no drift in magnitude", "[models][gpu]") {
  if (!gpu_half_runs()) return;
  REQUIRE(fp8_products_run(c10::Device(c10::kCUDA)));
  at::manual_seed(17);
  const auto bf16 = at::TensorOptions(at::kBFloat16).device(c10::kCUDA);
  // A batch of 4 x 2048 tokens through the 1.1B's down projection (5632 -> 2048), whose sum
  // over 5632 inputs is the longest the bench's products run. Per element the bound above is
  // loose at this length; over the whole output, the accumulation and the result's rounding to
  // bf16 must stay well under e4m3's own rounding (about 4% for these operands), and must not
  // shrink or grow the output as a whole: the matrix units' fast accumulation truncates its
  // partial sums.
  const auto x = at::randn({8192, 5632}, bf16);
  const auto weight = (at::randn({2048, 5632}, bf16) * 0.02).to(at::kBFloat16);
  const auto grad = at::randn({8192, 2048}, bf16);
  struct Case {
    const char* product;
    at::Tensor actual, scaled;  // the product, and float64's of the same scaled operands
  };
  const Case cases[] = {
      {"forward", fp8_forward_product(x, weight), restored(quantize_rows(x)).mm(restored(quantize_rows(weight)).t())},
      {"input gradient", fp8_input_grad_product(grad, weight),
       restored(quantize_rows(grad)).mm(restored(quantize_rows(weight.t().contiguous())).t())},
  };
  for (const auto& c : cases) {
    INFO(c.product);
    const auto actual = c.actual.to(at::kDouble);
    const double error = (actual - c.scaled).norm().item<double>() / c.scaled.norm().item<double>();
    const double drift = (actual.abs().sum() / c.scaled.abs().sum()).item<double>() - 1;
    // Printed on every GPU run: the figures that tell the fast accumulation's cost in a log.
    WARN(c.product << ": error " << error << ", drift " << drift);
    CHECK(error < 0.01);
    CHECK(std::abs(drift) < 0.005);
  }
}

TEST_CASE("a Linear and a joint q/k/v projection that multiply in float8 on a GPU", "[models][gpu]") {
  if (!gpu_half_runs()) return;
  const c10::Device gpu(c10::kCUDA);
  REQUIRE(fp8_products_run(gpu));
  at::manual_seed(7);
  const auto bf16 = at::TensorOptions(at::kBFloat16).device(gpu);
  // Three projections whose weights lie end to end in one buffer, as a unit gathers them.
  const auto buffer = at::randn({(64 + 32 + 32) * 128}, bf16) * 0.05;
  std::vector<std::shared_ptr<Linear>> linears;
  int64_t offset = 0;
  for (int64_t rows : {64, 32, 32}) {
    linears.push_back(std::make_shared<Linear>(buffer.narrow(0, offset, rows * 128).view({rows, 128})));
    linears.back()->fp8_products = true;
    offset += rows * 128;
  }
  const auto x = at::randn({3, 40, 128}, bf16).requires_grad_(true);
  const auto joint = joint_projection({linears[0].get(), linears[1].get(), linears[2].get()}, x);
  REQUIRE(joint.defined());
  CHECK(backward_runs(joint, "JointProjection"));
  // Each Linear alone: its forward is the float8 product.
  std::vector<at::Tensor> alone;
  for (const auto& linear : linears) alone.push_back((*linear)(x));
  CHECK(backward_runs(alone[0], "Fp8Linear"));
  // The joint product scales the same rows of x and of each weight: the same product, within
  // the accumulation's order. Its input gradient scales each column over all three weights.
  const auto separate = at::cat(alone, -1);
  CHECK(relative_error(joint.to(at::kFloat), separate.to(at::kFloat)) < std::ldexp(1.0, -6));
  const auto grad = at::randn_like(joint);
  const auto joint_grad = torch::autograd::grad({joint}, {x}, {grad})[0];
  const auto separate_grad = torch::autograd::grad({separate}, {x}, {grad})[0];
  CHECK((joint_grad - separate_grad).to(at::kDouble).norm().item<double>() <
        0.08 * separate_grad.to(at::kDouble).norm().item<double>());
}
