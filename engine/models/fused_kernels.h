// CUDA kernels for the elementwise steps of a decoder layer that ATen runs as several
// memory-bound passes: SwiGLU and RoPE, forward and backward, one pass each. Plain pointers
// and sizes, so the CUDA sources (fused_kernels.cu) include no ATen and models/elementwise
// includes no CUDA. Every launch goes on the current stream of `device`; element math is
// float32, rounded once to the element type.
#pragma once

#include <cstdint>

namespace fsdpp::kernels {

enum class Element { kFloat, kBFloat16, kHalf };

// out = silu(gate) * up over n contiguous elements.
void swiglu_forward(Element element, int device, const void* gate, const void* up, void* out, int64_t n);
// The gradients of gate and up from the output's `grad`, all n contiguous elements.
void swiglu_backward(Element element, int device, const void* grad, const void* gate, const void* up,
                     void* grad_gate, void* grad_up, int64_t n);

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

}  // namespace fsdpp::kernels
