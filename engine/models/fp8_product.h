// Linear products in float8, for the units of a plan that declare precision{compute = "fp8"}.
// Each operand is scaled into e4m3's range with one power-of-two factor per row of the
// product (per token of the input, per output feature of the weight), so the factors lie
// outside the sum over the inner dimension: the GPU's FP8 matrix units (at::_scaled_mm)
// accumulate (the forward in their faster mode, the input's gradient in full float32), apply
// both factors and round the result to bf16 once.
//
// The recipe: the forward product and the input's gradient run in float8; the weight's
// gradient, whose sum runs over every token of the batch, runs in bf16, as does the rest of
// the layer. Parameters are gathered and kept in bf16 and the masters stay float32, so
// float8 exists only inside each product.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace fsdpp {

// The largest finite value of float8 e4m3 (the "fn" variant: no infinities).
inline constexpr double kE4m3Max = 448.0;

// Rows in float8 and the factor that restores each.
struct Fp8Rows {
  at::Tensor values;   // [R, C] float8_e4m3fn: row r times 2^k_r, rounded
  at::Tensor inverse;  // [R, 1] float32: 2^-k_r, what values are multiplied by to restore the row
};

// Scales each row of `x` [R, C] by the largest power of two that keeps it within ±448 and
// rounds it to e4m3: one pass of a fused kernel on a GPU, ATen ops giving the same bits
// elsewhere. Powers of two make scaling exact, so rounding to e4m3 is the only error. A row
// of zeros restores to zeros, and a row holding inf or nan to non-finite values.
Fp8Rows quantize_rows(const at::Tensor& x);
// The same per column of `weight` [N, K], as the right operand of a product over N: values
// [N, K] laid out column-major (the layout at::_scaled_mm takes on the right) and factors
// [1, K]. On a GPU one reduction and one transposing pass, with the host's bits.
Fp8Rows quantize_columns(const at::Tensor& weight);

// x [M, K] times weight [N, K] transposed -> [M, N] bf16; x scaled per row, weight per row.
at::Tensor fp8_forward_product(const at::Tensor& x, const at::Tensor& weight);
// grad [M, N] times weight [N, K] -> [M, K] bf16; grad scaled per row, weight per column.
at::Tensor fp8_input_grad_product(const at::Tensor& grad, const at::Tensor& weight);

// x [..., K] through weight [N, K] without bias -> [..., N] bf16, with autograd: the input's
// gradient in float8, the weight's in bf16 (see above). Both bf16, on a GPU that
// fp8_products_run.
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight);

// Whether a weight [N, K] fits the FP8 matrix units: both sizes multiples of 16.
bool fp8_product_fits(const at::Tensor& weight);

// Whether `device` runs rowwise-scaled float8 products: a GPU of compute capability 9.0 or
// newer with a LibTorch that has them. Asked once per device by running one on a few ones:
// c10 reports no compute capability without the CUDA headers.
bool fp8_products_run(const c10::Device& device);

}  // namespace fsdpp
