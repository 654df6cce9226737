// The elementwise steps of a decoder layer around its products: SwiGLU and RoPE. On a GPU in
// float32, bf16 or fp16 each runs as one CUDA kernel each way (models/fused_kernels, where the
// build has them), rounding once; elsewhere as ATen ops, rounding where transformers rounds.
#pragma once

#include <ATen/core/Tensor.h>

namespace fsdpp {

// silu(gate) * up, the gated MLP's inner activation (gate and up of one shape).
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);
// The same from one joint product of gate_proj and up_proj [..., 2I]: gate the first I
// columns of each row, up the last I -> [..., I].
at::Tensor swiglu_joined(const at::Tensor& gate_up);

// Rotates q or k [B, H, T, D] by the tables [2, T, D] or [2, B, T, D] from RotaryEmbedding;
// vision tokens [H, N, D] by tables [2, N, D].
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos_sin);
// The tables as apply_rotary's GPU kernel reads them, float32, widened once for every tensor
// they rotate (a unit computing in bf16 casts them to bf16; widening back is exact); on the
// host, as they are.
at::Tensor widened_rotary_tables(const at::Tensor& cos_sin);

}  // namespace fsdpp
