// CUDA kernels for the steps of a decoder layer that ATen runs as several memory-bound
// passes: SwiGLU and RoPE (fused_kernels.cu), the residual add with the RMSNorm after it
// (norm_kernels.cu), forward and backward, and float8's rowwise scaling (fp8_kernels.cu). Plain pointers and sizes, so the CUDA sources
// include no ATen and their callers include no CUDA. Every launch goes on the current stream of `device`; element math is
// float32, rounded once to the element type.
#pragma once

#include <cstdint>

namespace fsdpp::kernels {

enum class Element { kFloat, kBFloat16, kHalf };

// out = silu(gate) * up over `rows` rows of `width` elements: gate's and up's rows lie
// `stride` elements apart (width where each is contiguous; twice the width where they are the
// halves of one joint product's rows), out's rows are contiguous.
void swiglu_forward(Element element, int device, const void* gate, const void* up, void* out, int64_t rows,
                    int64_t width, int64_t stride);
// The gradients of gate and up from the output's `grad` (contiguous rows), written with
// gate's and up's layout.
void swiglu_backward(Element element, int device, const void* grad, const void* gate, const void* up,
                     void* grad_gate, void* grad_up, int64_t rows, int64_t width, int64_t stride);

// A tensor [batch, heads, tokens, dim] rotated by float32 tables cos and sin of [tokens, dim]
// (one for every sequence) or [batch, tokens, dim], both contiguous.
struct RotaryShape {
  int64_t batch = 0, heads = 0, tokens = 0, dim = 0;  // dim even
  int64_t in_strides[3] = {};   // of the input over (batch, heads, tokens); dim is contiguous
  int64_t out_strides[3] = {};  // the same for the output
  bool table_per_sequence = false;
};
// out = x * cos + rotate_half(x) * sin, the tables rounded to the element type first as
// transformers rounds them; `transpose` applies the rotation's transpose instead (backward:
// the gradient of x from the gradient of out).
void rotary(Element element, int device, const void* x, const float* cos, const float* sin, void* out,
            const RotaryShape& shape, bool transpose);

// The widest row the residual RMSNorm kernels take: the backward keeps a float32 partial of
// the weight's gradient per column in shared memory.
constexpr int64_t kMaxNormWidth = 8192;

// Rows of `width` contiguous elements (width <= kMaxNormWidth): sum = x + delta, rounded to
// the element type; out = sum * rstd * weight, rounded once, with rstd = 1 / sqrt(mean(sum²) +
// eps) in float32, also written to `rstd` [rows] for backward.
void add_rms_norm_forward(Element element, int device, const void* x, const void* delta, const void* weight,
                          void* sum, void* out, float* rstd, int64_t rows, int64_t width, float eps);

// How many rows of float32 partial sums of the weight's gradient the backward writes.
int add_rms_norm_backward_blocks(int device, int64_t rows);

// The gradient of the sum from the output's `grad_out`, plus `grad_sum` (what the sum receives
// besides through the norm; null for none), rounded once into `grad_x` (which is also delta's).
// When `weight_partials` is given ([add_rms_norm_backward_blocks(), width] float32), block b
// writes there Σ grad_out * sum * rstd over its rows: the weight's gradient is their sum.
void add_rms_norm_backward(Element element, int device, const void* grad_out, const void* grad_sum,
                           const void* sum, const void* weight, const float* rstd, void* grad_x,
                           float* weight_partials, int64_t rows, int64_t width);

// Below this a row's largest magnitude counts as a row of zeros when scaled to float8: 448 over
// it stays a finite float32 (2^108), where float32's smallest normal would overflow.
constexpr float kSmallestFp8Amax = 1e-30f;

// Each of `rows` contiguous rows of `width` elements times 2^k, the largest power of two that
// keeps the row within ±448 (k = 0 for a row holding inf or nan), rounded to e4m3 into
// `values` (one byte each, row-major); `inverse` [rows] gets 2^-k.
void quantize_rows_fp8(Element element, int device, const void* x, void* values, float* inverse, int64_t rows,
                       int64_t width);

// The same per column of x [rows, cols] (contiguous), given each column's largest magnitude
// `amax` [cols] (float32): column c times its 2^k rounded to e4m3, written transposed into
// `values` [cols, rows] (row-major), and 2^-k into `inverse` [cols].
void quantize_columns_fp8(Element element, int device, const void* x, const float* amax, void* values, float* inverse,
                          int64_t rows, int64_t cols);

}  // namespace fsdpp::kernels
