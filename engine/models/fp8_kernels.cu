// Rowwise float8 scaling in one pass over memory: a block per row finds the row's largest
// magnitude, then writes the row times its power-of-two factor rounded to e4m3, and the
// factor's inverse. The factor is built from the magnitude's exponent bits, as
// models/fp8_product.cpp builds it from ATen ops, so both give the same bits.
#include "models/kernel_common.cuh"

#include <cuda_fp8.h>

namespace fsdpp::kernels {

namespace {

// NaN wins, as ATen's amax lets it.
__device__ inline float max_magnitude(float a, float b) { return (isnan(a) || a > b) ? a : b; }

// 2^k as a float32 from its exponent bits (k within float32's normal range).
__device__ inline float power_of_two(int k) { return __int_as_float((k + 127) << 23); }

template <typename T>
__global__ void quantize_rows_kernel(const T* __restrict__ x, __nv_fp8_storage_t* __restrict__ values,
                                     float* __restrict__ inverse, int64_t width) {
  __shared__ float partial[kThreads / 32];
  const T* row = x + blockIdx.x * width;
  float amax = 0.0f;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) amax = max_magnitude(fabsf(widen(row[i])), amax);
  for (int offset = 16; offset > 0; offset /= 2) amax = max_magnitude(__shfl_xor_sync(0xffffffff, amax, offset), amax);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = partial[0];
  for (int w = 1; w < kThreads / 32; ++w) amax = max_magnitude(partial[w], amax);
  // amax = m * 2^e, m in [0.5, 1): the largest k with amax * 2^k <= 448 = 0.875 * 2^9. A row
  // of zeros counts as one of kSmallestFp8Amax; a non-finite row keeps the factor 1.
  int e = 0;
  const float m = frexpf(fmaxf(amax, kSmallestFp8Amax), &e);
  const int k = isfinite(amax) ? 9 - e - (m > 0.875f ? 1 : 0) : 0;
  const float scale = power_of_two(k);
  if (threadIdx.x == 0) inverse[blockIdx.x] = power_of_two(-k);
  __nv_fp8_storage_t* out = values + blockIdx.x * width;
  // No saturation: the scaled row is within ±448, and inf or NaN become e4m3's NaN, as ATen's
  // conversion makes them.
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    out[i] = __nv_cvt_float_to_fp8(widen(row[i]) * scale, __NV_NOSAT, __NV_E4M3);
  }
}

}  // namespace

void quantize_rows_fp8(Element element, int device, const void* x, void* values, float* inverse, int64_t rows,
                       int64_t width) {
  if (rows == 0) return;
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max(), "fp8 quantize: ", rows, " rows exceed one grid");
  launch_typed(element, device, [&](auto zero, cudaStream_t stream) {
    using T = decltype(zero);
    quantize_rows_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<__nv_fp8_storage_t*>(values), inverse, width);
  });
}

}  // namespace fsdpp::kernels
