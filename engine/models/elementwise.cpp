// SwiGLU and RoPE, fused on a GPU (custom autograd functions over models/fused_kernels) or
// composed of ATen ops.
#include "models/elementwise.h"

#include <ATen/ATen.h>

#ifdef FSDPP_CUDA_KERNELS
#include "models/kernel_element.h"

#include <torch/csrc/autograd/custom_function.h>
#endif

namespace fsdpp {

namespace {

#ifdef FSDPP_CUDA_KERNELS
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Saves gate and up, where ATen's pair of ops would also keep silu(gate).
struct FusedSwiGLU : public torch::autograd::Function<FusedSwiGLU> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    const auto g = gate.contiguous(), u = up.contiguous();
    auto out = at::empty_like(g);
    at::RecordFunction record(at::RecordScope::FUNCTION);
    if (record.isActive()) describe_kernel(record, "fsdpp::swiglu_forward", {g, u}, {out});
    kernels::swiglu_forward(*kernel_element(g), g.get_device(), g.const_data_ptr(), u.const_data_ptr(),
                            out.mutable_data_ptr(), g.numel());
    ctx->save_for_backward({g, u});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    const auto dy = grads[0].contiguous();
    auto grad_gate = at::empty_like(saved[0]), grad_up = at::empty_like(saved[1]);
    at::RecordFunction record(at::RecordScope::FUNCTION);
    if (record.isActive()) {
      describe_kernel(record, "fsdpp::swiglu_backward", {dy, saved[0], saved[1]}, {grad_gate, grad_up});
    }
    kernels::swiglu_backward(*kernel_element(dy), dy.get_device(), dy.const_data_ptr(), saved[0].const_data_ptr(),
                             saved[1].const_data_ptr(), grad_gate.mutable_data_ptr(), grad_up.mutable_data_ptr(),
                             dy.numel());
    return {grad_gate, grad_up};
  }
};

// x [B, H, T, D] (any strides but a contiguous last dim) rotated into a new tensor of x's
// layout; cos and sin [T, D] or [B, T, D], contiguous float32.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool transpose) {
  const auto in = x.stride(-1) == 1 ? x : x.contiguous();
  auto out = at::empty_like(in);
  kernels::RotaryShape shape{.batch = in.size(0),
                             .heads = in.size(1),
                             .tokens = in.size(2),
                             .dim = in.size(3),
                             .in_strides = {in.stride(0), in.stride(1), in.stride(2)},
                             .out_strides = {out.stride(0), out.stride(1), out.stride(2)},
                             .table_per_sequence = cos.dim() == 3};
  at::RecordFunction record(at::RecordScope::FUNCTION);
  if (record.isActive()) describe_kernel(record, "fsdpp::rotary", {in, cos, sin}, {out});
  kernels::rotary(*kernel_element(in), in.get_device(), in.const_data_ptr(), cos.const_data_ptr<float>(),
                  sin.const_data_ptr<float>(), out.mutable_data_ptr(), shape, transpose);
  return out;
}

// The rotation is linear in x: backward rotates the gradient by its transpose, from the tables alone.
struct FusedRotary : public torch::autograd::Function<FusedRotary> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rotate(x, cos, sin, /*transpose=*/false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    return {rotate(grads[0], saved[0], saved[1], /*transpose=*/true), at::Tensor(), at::Tensor()};
  }
};

// Whether the rotary kernel takes x [B, H, T, D] with these tables: float32 ones, or tables
// a unit cast to its compute dtype with the rest of its inputs (bf16 or fp16), which widen to
// float32 exactly.
bool rotary_kernel_takes(const at::Tensor& x, const at::Tensor& cos_sin) {
  if (!kernel_element(x) || x.dim() != 4 || x.size(3) % 2 != 0) return false;
  if (!kernel_element(cos_sin) || cos_sin.device() != x.device() || cos_sin.size(0) != 2) return false;
  const auto tables = cos_sin.sizes();
  if (tables.size() == 3) return tables[1] == x.size(2) && tables[2] == x.size(3);
  return tables.size() == 4 && tables[1] == x.size(0) && tables[2] == x.size(2) && tables[3] == x.size(3);
}
#endif

}  // namespace

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
#ifdef FSDPP_CUDA_KERNELS
  if (kernel_element(gate) && up.scalar_type() == gate.scalar_type() && up.device() == gate.device() &&
      up.sizes() == gate.sizes()) {
    return FusedSwiGLU::apply(gate, up);
  }
#endif
  return at::silu(gate) * up;
}

at::Tensor widened_rotary_tables(const at::Tensor& cos_sin) {
  return cos_sin.is_cuda() ? cos_sin.to(at::kFloat) : cos_sin;
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos_sin) {
#ifdef FSDPP_CUDA_KERNELS
  if (rotary_kernel_takes(x, cos_sin)) {
    const auto tables = cos_sin.to(at::kFloat);  // [2, T, D] or [2, B, T, D]
    return FusedRotary::apply(x, tables[0].contiguous(), tables[1].contiguous());
  }
#endif
  const int64_t half = x.size(-1) / 2;
  auto cos = cos_sin[0].to(x.scalar_type());  // [T, D] or [B, T, D]
  auto sin = cos_sin[1].to(x.scalar_type());
  if (cos.dim() == 3) {  // per sequence: broadcast over heads
    cos = cos.unsqueeze(1);
    sin = sin.unsqueeze(1);
  }
  // transformers' rotate_half(x) * sin, with the sign moved onto the small table: the halves
  // of x swapped by one flip (one pass each way, where negating and concatenating them costs
  // three forward and five backward), times sin with its first half negated.
  auto swapped = x.unflatten(-1, {2, half}).flip(-2).flatten(-2);  // [x2, x1]
  auto signed_sin = at::cat({-sin.narrow(-1, 0, half), sin.narrow(-1, half, half)}, -1);
  return at::addcmul(x * cos, swapped, signed_sin);
}

}  // namespace fsdpp
