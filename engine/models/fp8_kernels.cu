// Float8 scaling kernels. Rowwise in one kernel: a block per row finds the row's largest
// magnitude, then writes the row times its power-of-two factor rounded to e4m3 (reading the
// row again, mostly from cache), and the factor's inverse. Columnwise from the columns' largest
// magnitudes: tiles through shared memory, written transposed. Each factor is built from the
// magnitude's exponent bits, as models/fp8_product.cpp builds it from ATen ops, so both give
// the same bits.
#include "models/kernel_common.cuh"

#include <cuda_fp8.h>

#include <algorithm>

namespace fsdpp::kernels {

namespace {

// NaN wins, as ATen's amax lets it.
struct MaxMagnitude {
  __device__ float operator()(float a, float b) const { return (isnan(a) || a > b) ? a : b; }
};

// 2^k as a float32 from its exponent bits (k within float32's normal range).
__device__ inline float power_of_two(int k) { return __int_as_float((k + 127) << 23); }

// The factor 2^k for a row (or column) whose largest magnitude is amax: amax = m * 2^e, m in
// [0.5, 1), and k the largest with amax * 2^k <= 448 = 0.875 * 2^9. A row of zeros counts as
// one of kSmallestFp8Amax; a non-finite row keeps the factor 1.
struct Fp8Scale {
  float factor, inverse;
  bool finite;
};

__device__ inline Fp8Scale fp8_scale(float amax) {
  const bool finite = isfinite(amax);
  int e = 0;
  const float m = frexpf(fmaxf(amax, kSmallestFp8Amax), &e);
  const int k = finite ? 9 - e - (m > 0.875f ? 1 : 0) : 0;
  return {power_of_two(k), power_of_two(-k), finite};
}

// v, already scaled, in e4m3. A finite row scaled is within ±448, so the saturating conversion
// rounds it as ATen's does; a row holding inf or nan takes the exact conversion, which makes
// them e4m3's NaN as ATen does.
__device__ inline __nv_fp8_storage_t to_e4m3(float v, bool finite) {
  return __nv_cvt_float_to_fp8(v, finite ? __NV_SATFINITE : __NV_NOSAT, __NV_E4M3);
}

// A block per row at a time; each thread reads packs of N elements (16 bytes where the
// pointers and the width allow) and writes N bytes.
template <typename T, int N>
__global__ void quantize_rows_kernel(const T* x, __nv_fp8_storage_t* values, float* inverse, int64_t rows,
                                     int64_t width) {
  __shared__ float scratch[kWarps];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* in = x + row * width;
    float amax = 0.0f;
    for (int64_t c = threadIdx.x * N; c < width; c += kThreads * N) {
      const auto a = load<T, N>(in + c);
#pragma unroll
      for (int i = 0; i < N; ++i) amax = MaxMagnitude()(fabsf(widen(a.v[i])), amax);
    }
    const Fp8Scale scale = fp8_scale(block_reduce(amax, scratch, MaxMagnitude()));
    __nv_fp8_storage_t* out = values + row * width;
    // Each thread reads back only the columns it read; a finite row converts two at a time.
    for (int64_t c = threadIdx.x * N; c < width; c += kThreads * N) {
      const auto a = load<T, N>(in + c);
      Pack<__nv_fp8_storage_t, N> q;
      if (scale.finite && N % 2 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 2) {
          const __nv_fp8x2_storage_t pair =
              __nv_cvt_float2_to_fp8x2(make_float2(widen(a.v[i]) * scale.factor, widen(a.v[i + 1]) * scale.factor),
                                       __NV_SATFINITE, __NV_E4M3);
          q.v[i] = static_cast<__nv_fp8_storage_t>(pair & 0xff);  // the first value in the low byte
          q.v[i + 1] = static_cast<__nv_fp8_storage_t>(pair >> 8);
        }
      } else {
#pragma unroll
        for (int i = 0; i < N; ++i) q.v[i] = to_e4m3(widen(a.v[i]) * scale.factor, scale.finite);
      }
      store<__nv_fp8_storage_t, N>(out + c, q);
    }
    if (threadIdx.x == 0) inverse[row] = scale.inverse;
  }
}

constexpr int kTile = 64;

// A block moves a kTile x kTile tile of x [rows, cols] through shared memory: it reads along
// x's rows and writes along values' rows (values [cols, rows], column c of x scaled by the
// factor of amax[c]), so both are contiguous across a warp.
template <typename T>
__global__ void quantize_columns_kernel(const T* x, const float* amax, __nv_fp8_storage_t* values, float* inverse,
                                        int64_t rows, int64_t cols) {
  __shared__ float tile[kTile][kTile + 1];  // one column of padding: no bank conflicts when read across
  constexpr int kLanes = kThreads / kTile;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile, c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int lane = threadIdx.x % kTile, step = threadIdx.x / kTile;
  for (int i = step; i < kTile; i += kLanes) {
    const int64_t r = r0 + i, c = c0 + lane;
    tile[i][lane] = (r < rows && c < cols) ? widen(x[r * cols + c]) : 0.0f;
  }
  __syncthreads();
  for (int i = step; i < kTile; i += kLanes) {
    const int64_t c = c0 + i, r = r0 + lane;
    if (c >= cols) break;
    const Fp8Scale scale = fp8_scale(amax[c]);
    if (r < rows) values[c * rows + r] = to_e4m3(tile[lane][i] * scale.factor, scale.finite);
    if (blockIdx.y == 0 && lane == 0) inverse[c] = scale.inverse;
  }
}

}  // namespace

void quantize_rows_fp8(Element element, int device, const void* x, void* values, float* inverse, int64_t rows,
                       int64_t width) {
  if (rows == 0 || width == 0) return;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(rows, std::numeric_limits<int32_t>::max()));
  launch_typed(element, device, [&](auto zero, cudaStream_t stream) {
    using T = decltype(zero);
    const auto* in = static_cast<const T*>(x);
    auto* out = static_cast<__nv_fp8_storage_t*>(values);
    launch_rows<T>(width, {in, out}, [&](auto pack) {
      quantize_rows_kernel<T, decltype(pack)::value><<<blocks, kThreads, 0, stream>>>(in, out, inverse, rows, width);
    });
  });
}

void quantize_columns_fp8(Element element, int device, const void* x, const float* amax, void* values, float* inverse,
                          int64_t rows, int64_t cols) {
  if (rows == 0 || cols == 0) return;
  const int64_t tile_rows = (rows + kTile - 1) / kTile;
  TORCH_CHECK(tile_rows <= 65535, "fused float8 columns: ", rows, " rows exceed one grid");
  const dim3 blocks(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>(tile_rows));
  launch_typed(element, device, [&](auto zero, cudaStream_t stream) {
    using T = decltype(zero);
    quantize_columns_kernel<T><<<blocks, kThreads, 0, stream>>>(
        static_cast<const T*>(x), amax, static_cast<__nv_fp8_storage_t*>(values), inverse, rows, cols);
  });
}

}  // namespace fsdpp::kernels
