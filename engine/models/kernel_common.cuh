// What the fused CUDA kernels share: element types widened to float32 and rounded back once
// (as ATen rounds), 16-byte packs, grid sizes, and a launch on the current stream for each
// element type. Included by .cu sources only.
#pragma once

#include "models/fused_kernels.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>

namespace fsdpp::kernels {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ inline float widen(float x) { return x; }
__device__ inline float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline float widen(__half x) { return __half2float(x); }

// Round to nearest even, as ATen rounds float32 to bf16 and fp16.
template <typename T>
__device__ T narrow_to(float x);
template <>
__device__ inline float narrow_to<float>(float x) { return x; }
template <>
__device__ inline __nv_bfloat16 narrow_to<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ inline __half narrow_to<__half>(float x) { return __float2half_rn(x); }

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ Pack<T, N> load(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <typename T, int N>
__device__ void store(T* p, const Pack<T, N>& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

// `combine` (associative) over every thread's `value`, in every thread, in a fixed order.
// `scratch` holds kWarps floats.
template <typename Combine>
__device__ float block_reduce(float value, float* scratch, Combine combine) {
  for (int offset = 16; offset > 0; offset /= 2) value = combine(value, __shfl_xor_sync(0xffffffffu, value, offset));
  __syncthreads();  // every thread has read the previous call's partials
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  float total = scratch[0];
  for (int w = 1; w < kWarps; ++w) total = combine(total, scratch[w]);
  return total;
}

// Whether every pointer may load and store 16-byte packs.
inline bool pack_aligned(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

inline unsigned blocks_for(int64_t threads) {
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "fused kernel: ", threads, " threads exceed one grid");
  return static_cast<unsigned>(blocks);
}

// Calls launch(width) with packs of 16 bytes of T where every pointer is 16-byte aligned and
// the rows are whole packs, else with single elements.
template <typename T, typename Launch>
void launch_rows(int64_t width, std::initializer_list<const void*> pointers, Launch launch) {
  constexpr int kPack = 16 / sizeof(T);
  if (pack_aligned(pointers) && width % kPack == 0) {
    launch(std::integral_constant<int, kPack>());
  } else {
    launch(std::integral_constant<int, 1>());
  }
}

// Calls launch(zero, stream) with a zero value of the element's CUDA type and the current
// stream of `device` (made current meanwhile), then checks the launch.
template <typename Launch>
void launch_typed(Element element, int device, Launch launch) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (element) {
    case Element::kFloat:
      launch(float{}, stream);
      break;
    case Element::kBFloat16:
      launch(__nv_bfloat16{}, stream);
      break;
    case Element::kHalf:
      launch(__half{}, stream);
      break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fsdpp::kernels
