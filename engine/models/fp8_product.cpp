// Float8 products: rowwise power-of-two scaling, at::_scaled_mm, and the Linear's autograd.
#include "models/fp8_product.h"

#include "models/kernel_element.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <limits>
#include <map>
#include <mutex>

namespace fsdpp {

namespace {

// 2^k for each integer k [R, 1], from its float32 exponent bits: exact on every device.
at::Tensor power_of_two(const at::Tensor& k) { return at::bitwise_left_shift(k + 127, 23).view(at::kFloat); }

// The ATen ops the GPU's kernel fuses (models/fp8_kernels.cu), bit for bit: the host's path.
Fp8Rows quantize_rows_composed(const at::Tensor& input) {
  const auto x = input.contiguous();  // [R, C]: the layout _scaled_mm reads on the left
  const auto amax = x.abs().amax(1, /*keepdim=*/true).to(at::kFloat);  // [R, 1]
  // amax = m * 2^e, m in [0.5, 1): the largest k with amax * 2^k <= 448 = 0.875 * 2^9, from
  // the bits rather than a logarithm, whose rounding differs between devices.
  const auto [mantissa, exponent] = at::frexp(amax.clamp_min(kernels::kSmallestFp8Amax));
  const auto k = at::where(amax.isfinite(), 9 - exponent - mantissa.gt(0.875).to(at::kInt), 0);  // [R, 1] int
  return {(x.to(at::kFloat) * power_of_two(k)).to(at::kFloat8_e4m3fn), power_of_two(-k)};
}

// a [M, inner] row-major times b [inner, N] column-major, each with its factors, -> [M, N]
// bf16. `fast_accumulation` lets the tensor cores accumulate in their faster, less precise
// mode.
at::Tensor scaled_product(const Fp8Rows& a, const at::Tensor& b, const at::Tensor& b_inverse, bool fast_accumulation) {
  return at::_scaled_mm(a.values, b, a.inverse, b_inverse, /*bias=*/std::nullopt, /*scale_result=*/std::nullopt,
                        at::kBFloat16, fast_accumulation);
}

struct Fp8Linear : public torch::autograd::Function<Fp8Linear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    // The parameter itself is saved, not a view of it: FSDP frees a unit's gathered storage
    // after forward and gathers it again into the same tensor before backward.
    ctx->save_for_backward({x, weight});
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    return fp8_forward_product(x.reshape({-1, x.size(-1)}), weight).view(sizes);  // [..., N]
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];       // [..., K]
    const at::Tensor& weight = saved[1];  // [N, K]
    const auto grad = grads[0].reshape({-1, weight.size(0)});  // [M, N]
    torch::autograd::variable_list result(2);
    if (ctx->needs_input_grad(0)) result[0] = fp8_input_grad_product(grad, weight).view(x.sizes());
    // Summed over every token of the batch, the weight's gradient stays in bf16.
    if (ctx->needs_input_grad(1)) result[1] = grad.t().mm(x.reshape({-1, x.size(-1)}));  // [N, K]
    return result;
  }
};

}  // namespace

Fp8Rows quantize_rows(const at::Tensor& x) {
#ifdef FSDPP_CUDA_KERNELS
  if (const auto element = kernel_element(x)) {
    const auto rows = x.contiguous();  // [R, C]
    Fp8Rows out{at::empty(rows.sizes(), rows.options().dtype(at::kFloat8_e4m3fn)),
                at::empty({rows.size(0), 1}, rows.options().dtype(at::kFloat))};
    at::RecordFunction record(at::RecordScope::FUNCTION);
    if (record.isActive()) describe_kernel(record, "fsdpp::quantize_rows_fp8", {rows}, {out.values, out.inverse});
    kernels::quantize_rows_fp8(*element, rows.get_device(), rows.const_data_ptr(), out.values.mutable_data_ptr(),
                               out.inverse.mutable_data_ptr<float>(), rows.size(0), rows.size(1));
    return out;
  }
#endif
  return quantize_rows_composed(x);
}

Fp8Rows quantize_columns(const at::Tensor& weight) {
#ifdef FSDPP_CUDA_KERNELS
  if (const auto element = kernel_element(weight)) {
    const auto x = weight.contiguous();  // [N, K]
    // Each column's largest magnitude in one reduction (NaN wins, as in amax), then one pass
    // that scales, rounds and transposes: no transposed bf16 copy.
    const auto amax = at::linalg_vector_norm(x, std::numeric_limits<double>::infinity(), {0}, /*keepdim=*/false, at::kFloat);  // [K]
    Fp8Rows t{at::empty({x.size(1), x.size(0)}, x.options().dtype(at::kFloat8_e4m3fn)),
              at::empty({1, x.size(1)}, x.options().dtype(at::kFloat))};
    at::RecordFunction record(at::RecordScope::FUNCTION);
    if (record.isActive()) describe_kernel(record, "fsdpp::quantize_columns_fp8", {x, amax}, {t.values, t.inverse});
    kernels::quantize_columns_fp8(*element, x.get_device(), x.const_data_ptr(), amax.const_data_ptr<float>(),
                                  t.values.mutable_data_ptr(), t.inverse.mutable_data_ptr<float>(), x.size(0),
                                  x.size(1));
    return {t.values.t(), t.inverse};  // [N, K] column-major, [1, K]
  }
#endif
  Fp8Rows t = quantize_rows_composed(weight.t().contiguous());  // [K, N], [K, 1]
  return {t.values.t(), t.inverse.t()};
}

at::Tensor fp8_forward_product(const at::Tensor& x, const at::Tensor& weight) {
  const Fp8Rows w = quantize_rows(weight);  // [N, K], [N, 1]
  // An output's rounding errors do not compound through a backward, so the forward takes the
  // faster accumulation; the input's gradient does not.
  return scaled_product(quantize_rows(x), w.values.t(), w.inverse.t(), /*fast_accumulation=*/true);
}

at::Tensor fp8_input_grad_product(const at::Tensor& grad, const at::Tensor& weight) {
  const Fp8Rows w = quantize_columns(weight);  // [N, K] column-major, [1, K]
  return scaled_product(quantize_rows(grad), w.values, w.inverse, /*fast_accumulation=*/false);
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight) { return Fp8Linear::apply(x, weight); }

bool fp8_product_fits(const at::Tensor& weight) {
  return weight.dim() == 2 && weight.size(0) % 16 == 0 && weight.size(1) % 16 == 0;
}

bool fp8_products_run(const c10::Device& device) {
  if (!device.is_cuda()) return false;
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, bool> known;
  std::lock_guard lock(mutex);
  if (auto it = known.find(device.index()); it != known.end()) return it->second;
  bool runs = false;
  try {
    at::NoGradGuard no_grad;
    const auto ones = at::ones({16, 16}, at::TensorOptions(at::kBFloat16).device(device));
    runs = fp8_forward_product(ones, ones).eq(16).all().item<bool>();
  } catch (const c10::Error&) {
    runs = false;
  }
  return known[device.index()] = runs;
}

}  // namespace fsdpp
