// SwiGLU and RoPE, fused on a GPU (custom autograd functions over models/fused_kernels) or
// composed of ATen ops.
#include "models/elementwise.h"

#include <ATen/ATen.h>

#include <torch/csrc/autograd/custom_function.h>

#ifdef FSDPP_CUDA_KERNELS
#include "models/kernel_element.h"
#endif

namespace fsdpp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// silu(gate) * up from the halves of a joint product [..., 2I], as ATen ops that round where
// transformers rounds; backward writes both halves' gradients into one [..., 2I] tensor,
// where autograd would join them in another copy.
struct ComposedJoinedSwiGLU : public torch::autograd::Function<ComposedJoinedSwiGLU> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up) {
    const int64_t width = gate_up.size(-1) / 2;
    const auto gate = gate_up.narrow(-1, 0, width), up = gate_up.narrow(-1, width, width);
    const auto activated = at::silu(gate);  // [..., I], kept as autograd would keep it
    ctx->save_for_backward({gate_up, activated});
    return activated * up;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &gate_up = saved[0], &activated = saved[1];
    const auto& dy = grads[0];
    const int64_t width = gate_up.size(-1) / 2;
    auto grad = at::empty_like(gate_up, at::MemoryFormat::Contiguous);
    auto grad_gate = grad.narrow(-1, 0, width), grad_up = grad.narrow(-1, width, width);
    at::mul_out(grad_up, dy, activated);
    at::silu_backward_out(grad_gate, dy * gate_up.narrow(-1, width, width), gate_up.narrow(-1, 0, width));
    return {grad};
  }
};

#ifdef FSDPP_CUDA_KERNELS

// The fused SwiGLU over `rows` rows of `width` elements whose gate and up rows lie `stride`
// apart in `sources` (the tensors it reads, gate's first); out [sizes], contiguous.
at::Tensor swiglu_rows(const std::vector<at::Tensor>& sources, const void* gate, const void* up,
                       at::IntArrayRef sizes, int64_t rows, int64_t width, int64_t stride) {
  const at::Tensor& first = sources.front();
  auto out = at::empty(sizes, first.options());
  at::RecordFunction record(at::RecordScope::FUNCTION);
  if (record.isActive()) describe_kernel(record, "fsdpp::swiglu_forward", {sources.begin(), sources.end()}, {out});
  kernels::swiglu_forward(*kernel_element(first), first.get_device(), gate, up, out.mutable_data_ptr(), rows, width,
                          stride);
  return out;
}

// Its backward from the output's gradient `dy` (contiguous rows): gate's and up's gradients
// written with their layout into `grads`.
void swiglu_rows_backward(const at::Tensor& dy, const std::vector<at::Tensor>& sources, const void* gate,
                          const void* up, const std::vector<at::Tensor>& grads, void* grad_gate, void* grad_up,
                          int64_t rows, int64_t width, int64_t stride) {
  std::vector<c10::IValue> reads{dy};
  reads.insert(reads.end(), sources.begin(), sources.end());
  at::RecordFunction record(at::RecordScope::FUNCTION);
  if (record.isActive()) describe_kernel(record, "fsdpp::swiglu_backward", reads, {grads.begin(), grads.end()});
  kernels::swiglu_backward(*kernel_element(dy), dy.get_device(), dy.const_data_ptr(), gate, up, grad_gate, grad_up,
                           rows, width, stride);
}

// Gate and up apart, as one row of all their elements. Saves them, where ATen's pair of ops
// would also keep silu(gate).
struct FusedSwiGLU : public torch::autograd::Function<FusedSwiGLU> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    const auto g = gate.contiguous(), u = up.contiguous();
    ctx->save_for_backward({g, u});
    return swiglu_rows({g, u}, g.const_data_ptr(), u.const_data_ptr(), g.sizes(), 1, g.numel(), g.numel());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    const auto dy = grads[0].contiguous();
    auto grad_gate = at::empty_like(saved[0]), grad_up = at::empty_like(saved[1]);
    const int64_t n = dy.numel();
    swiglu_rows_backward(dy, saved, saved[0].const_data_ptr(), saved[1].const_data_ptr(), {grad_gate, grad_up},
                         grad_gate.mutable_data_ptr(), grad_up.mutable_data_ptr(), 1, n, n);
    return {grad_gate, grad_up};
  }
};

// `offset` elements into t's memory.
const char* element_at(const at::Tensor& t, int64_t offset) {
  return static_cast<const char*>(t.const_data_ptr()) + offset * t.element_size();
}

// Gate and up as the halves of each row of one joint product [..., 2I]: the kernels read them
// in place, and backward writes both gradients into one [..., 2I] tensor, the joint product's
// gradient as it is.
struct FusedJoinedSwiGLU : public torch::autograd::Function<FusedJoinedSwiGLU> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up) {
    const auto joined = gate_up.contiguous();
    ctx->save_for_backward({joined});
    const int64_t width = joined.size(-1) / 2;
    auto sizes = joined.sizes().vec();
    sizes.back() = width;
    return swiglu_rows({joined}, joined.const_data_ptr(), element_at(joined, width), sizes,
                       joined.numel() / (2 * width), width, 2 * width);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor()};
    const at::Tensor joined = ctx->get_saved_variables()[0];
    const auto dy = grads[0].contiguous();
    const int64_t width = joined.size(-1) / 2;
    auto grad = at::empty_like(joined);
    auto* grad_gate = static_cast<char*>(grad.mutable_data_ptr());
    swiglu_rows_backward(dy, {joined}, joined.const_data_ptr(), element_at(joined, width), {grad}, grad_gate,
                         grad_gate + width * grad.element_size(), joined.numel() / (2 * width), width, 2 * width);
    return {grad};
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

at::Tensor swiglu_joined(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.size(-1) > 0 && gate_up.size(-1) % 2 == 0, "swiglu_joined: no halves in a width of ",
              gate_up.size(-1));
#ifdef FSDPP_CUDA_KERNELS
  if (kernel_element(gate_up)) return FusedJoinedSwiGLU::apply(gate_up);
#endif
  return ComposedJoinedSwiGLU::apply(gate_up);
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
