// The fused SwiGLU and RoPE kernels (see fused_kernels.h). Both are bound by memory: SwiGLU
// moves 16-byte packs per thread where every pointer allows it; RoPE gives each thread one
// pair of rotated elements (d, d + dim/2), rows ordered heads-fastest, which is how q and k
// lie in memory after their projection ([B, T, H, D] viewed as [B, H, T, D]).
#include "models/fused_kernels.h"

#include "models/kernel_common.cuh"

#include <type_traits>

namespace fsdpp::kernels {

namespace {

__device__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Thread t owns elements [t * N, t * N + N); the last thread's pack may run past n, and then
// goes element by element.
template <typename T, int N, typename Op>
__device__ void for_each_pack(int64_t n, Op op) {
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * N;
  if (first + N <= n) {
    op(first, std::integral_constant<int, N>());
  } else {
    for (int64_t i = first; i < n; ++i) op(i, std::integral_constant<int, 1>());
  }
}

template <typename T, int N>
__global__ void swiglu_forward_kernel(const T* gate, const T* up, T* out, int64_t n) {
  for_each_pack<T, N>(n, [&](int64_t at, auto width) {
    constexpr int W = decltype(width)::value;
    const auto g = *reinterpret_cast<const Pack<T, W>*>(gate + at);
    const auto u = *reinterpret_cast<const Pack<T, W>*>(up + at);
    Pack<T, W> o;
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const float x = widen(g.v[i]);
      o.v[i] = narrow_to<T>(x * sigmoid(x) * widen(u.v[i]));
    }
    *reinterpret_cast<Pack<T, W>*>(out + at) = o;
  });
}

template <typename T, int N>
__global__ void swiglu_backward_kernel(const T* grad, const T* gate, const T* up, T* grad_gate, T* grad_up,
                                       int64_t n) {
  for_each_pack<T, N>(n, [&](int64_t at, auto width) {
    constexpr int W = decltype(width)::value;
    const auto dy = *reinterpret_cast<const Pack<T, W>*>(grad + at);
    const auto g = *reinterpret_cast<const Pack<T, W>*>(gate + at);
    const auto u = *reinterpret_cast<const Pack<T, W>*>(up + at);
    Pack<T, W> dg, du;
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const float x = widen(g.v[i]), s = sigmoid(x), d = widen(dy.v[i]);
      du.v[i] = narrow_to<T>(d * x * s);
      dg.v[i] = narrow_to<T>(d * widen(u.v[i]) * s * (1.0f + x * (1.0f - s)));
    }
    *reinterpret_cast<Pack<T, W>*>(grad_gate + at) = dg;
    *reinterpret_cast<Pack<T, W>*>(grad_up + at) = du;
  });
}

// The transpose of the rotation (out_lo = lo c_lo - hi s_lo, out_hi = hi c_hi + lo s_hi) is
// the same rotation with s_lo' = -s_hi and s_hi' = -s_lo.
template <typename T>
__global__ void rotary_kernel(const T* x, const float* cos, const float* sin, T* out, RotaryShape shape,
                              bool transpose) {
  const int64_t half = shape.dim / 2;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= shape.batch * shape.tokens * shape.heads * half) return;
  const int64_t d = index % half;
  int64_t row = index / half;
  const int64_t h = row % shape.heads;
  row /= shape.heads;
  const int64_t t = row % shape.tokens;
  const int64_t b = row / shape.tokens;
  const T* in = x + b * shape.in_strides[0] + h * shape.in_strides[1] + t * shape.in_strides[2];
  T* to = out + b * shape.out_strides[0] + h * shape.out_strides[1] + t * shape.out_strides[2];
  const int64_t table = (shape.table_per_sequence ? b * shape.tokens + t : t) * shape.dim;
  const float c_lo = widen(narrow_to<T>(cos[table + d])), c_hi = widen(narrow_to<T>(cos[table + d + half]));
  float s_lo = widen(narrow_to<T>(sin[table + d])), s_hi = widen(narrow_to<T>(sin[table + d + half]));
  if (transpose) {
    const float s = s_lo;
    s_lo = -s_hi;
    s_hi = -s;
  }
  const float lo = widen(in[d]), hi = widen(in[d + half]);
  to[d] = narrow_to<T>(lo * c_lo - hi * s_lo);
  to[d + half] = narrow_to<T>(hi * c_hi + lo * s_hi);
}

// Calls launch(width, blocks) for packs of 16 bytes of T when every pointer is 16-byte
// aligned, else for single elements.
template <typename T, typename Launch>
void launch_packed(int64_t n, std::initializer_list<const void*> pointers, Launch launch) {
  constexpr int kPack = 16 / sizeof(T);
  if (pack_aligned(pointers)) {
    launch(std::integral_constant<int, kPack>(), blocks_for((n + kPack - 1) / kPack));
  } else {
    launch(std::integral_constant<int, 1>(), blocks_for(n));
  }
}

}  // namespace

void swiglu_forward(Element element, int device, const void* gate, const void* up, void* out, int64_t n) {
  if (n == 0) return;
  launch_typed(element, device, [&](auto zero, cudaStream_t stream) {
    using T = decltype(zero);
    const auto* g = static_cast<const T*>(gate);
    const auto* u = static_cast<const T*>(up);
    auto* o = static_cast<T*>(out);
    launch_packed<T>(n, {g, u, o}, [&](auto width, unsigned blocks) {
      swiglu_forward_kernel<T, decltype(width)::value><<<blocks, kThreads, 0, stream>>>(g, u, o, n);
    });
  });
}

void swiglu_backward(Element element, int device, const void* grad, const void* gate, const void* up,
                     void* grad_gate, void* grad_up, int64_t n) {
  if (n == 0) return;
  launch_typed(element, device, [&](auto zero, cudaStream_t stream) {
    using T = decltype(zero);
    const auto* dy = static_cast<const T*>(grad);
    const auto* g = static_cast<const T*>(gate);
    const auto* u = static_cast<const T*>(up);
    auto* dg = static_cast<T*>(grad_gate);
    auto* du = static_cast<T*>(grad_up);
    launch_packed<T>(n, {dy, g, u, dg, du}, [&](auto width, unsigned blocks) {
      swiglu_backward_kernel<T, decltype(width)::value><<<blocks, kThreads, 0, stream>>>(dy, g, u, dg, du, n);
    });
  });
}

void rotary(Element element, int device, const void* x, const float* cos, const float* sin, void* out,
            const RotaryShape& shape, bool transpose) {
  const int64_t pairs = shape.batch * shape.heads * shape.tokens * (shape.dim / 2);
  if (pairs == 0) return;
  launch_typed(element, device, [&](auto zero, cudaStream_t stream) {
    using T = decltype(zero);
    rotary_kernel<T><<<blocks_for(pairs), kThreads, 0, stream>>>(static_cast<const T*>(x), cos, sin,
                                                                 static_cast<T*>(out), shape, transpose);
  });
}

}  // namespace fsdpp::kernels
