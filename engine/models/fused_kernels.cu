// The fused SwiGLU and RoPE kernels (see fused_kernels.h). Both are bound by memory and move
// 16-byte packs per thread where every pointer allows it. RoPE gives a block each token, its
// heads side by side, which is how q and k lie in memory after their projection ([B, T, H, D]
// viewed as [B, H, T, D]).
#include "models/fused_kernels.h"

#include "models/kernel_common.cuh"

#include <algorithm>
#include <type_traits>

namespace fsdpp::kernels {

namespace {

__device__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Rows of `width` elements: thread t of a row's blocks owns columns [t * N, t * N + N) of
// every row its block's grid row reaches; a pack that runs past the width goes element by
// element.
template <typename T, int N, typename Op>
__device__ void for_each_pack(int64_t rows, int64_t width, Op op) {
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * N;
  if (first >= width) return;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    if (first + N <= width) {
      op(row, first, std::integral_constant<int, N>());
    } else {
      for (int64_t c = first; c < width; ++c) op(row, c, std::integral_constant<int, 1>());
    }
  }
}

// gate and up rows `stride` apart, out contiguous.
template <typename T, int N>
__global__ void swiglu_forward_kernel(const T* gate, const T* up, T* out, int64_t rows, int64_t width,
                                      int64_t stride) {
  for_each_pack<T, N>(rows, width, [&](int64_t row, int64_t c, auto pack) {
    constexpr int W = decltype(pack)::value;
    const auto g = load<T, W>(gate + row * stride + c);
    const auto u = load<T, W>(up + row * stride + c);
    Pack<T, W> o;
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const float x = widen(g.v[i]);
      o.v[i] = narrow_to<T>(x * sigmoid(x) * widen(u.v[i]));
    }
    store<T, W>(out + row * width + c, o);
  });
}

// grad contiguous; gate, up and their gradients rows `stride` apart.
template <typename T, int N>
__global__ void swiglu_backward_kernel(const T* grad, const T* gate, const T* up, T* grad_gate, T* grad_up,
                                       int64_t rows, int64_t width, int64_t stride) {
  for_each_pack<T, N>(rows, width, [&](int64_t row, int64_t c, auto pack) {
    constexpr int W = decltype(pack)::value;
    const int64_t at = row * stride + c;
    const auto dy = load<T, W>(grad + row * width + c);
    const auto g = load<T, W>(gate + at);
    const auto u = load<T, W>(up + at);
    Pack<T, W> dg, du;
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const float x = widen(g.v[i]), s = sigmoid(x), d = widen(dy.v[i]);
      du.v[i] = narrow_to<T>(d * x * s);
      dg.v[i] = narrow_to<T>(d * widen(u.v[i]) * s * (1.0f + x * (1.0f - s)));
    }
    store<T, W>(grad_gate + at, dg);
    store<T, W>(grad_up + at, du);
  });
}

// The table's N floats at p, rounded to T as transformers rounds its tables, then widened.
template <typename T, int N>
__device__ void load_table(const float* p, float (&v)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int k = 0; k < N; k += 4) {
      const auto q = load<float, 4>(p + k);
#pragma unroll
      for (int j = 0; j < 4; ++j) v[k + j] = widen(narrow_to<T>(q.v[j]));
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = widen(narrow_to<T>(p[k]));
  }
}

// A block per token (b, t), over all its heads: a thread rotates N pairs (d + k, d + k +
// dim/2) of one head. The token's place in memory is found once per thread; the head and pair
// come from 32-bit arithmetic. The transpose of the rotation (out_lo = lo c_lo - hi s_lo,
// out_hi = hi c_hi + lo s_hi) is the same rotation with s_lo' = -s_hi and s_hi' = -s_lo.
template <typename T, int N>
__global__ void rotary_kernel(const T* x, const float* cos, const float* sin, T* out, RotaryShape shape,
                              bool transpose) {
  const int64_t token = blockIdx.x;  // b * tokens + t
  const int64_t b = token / shape.tokens, t = token % shape.tokens;
  const int half = static_cast<int>(shape.dim / 2), packs = half / N;
  const int64_t table = (shape.table_per_sequence ? token : t) * shape.dim;
  const T* in_token = x + b * shape.in_strides[0] + t * shape.in_strides[2];
  T* out_token = out + b * shape.out_strides[0] + t * shape.out_strides[2];
  for (int i = threadIdx.x; i < shape.heads * packs; i += blockDim.x) {
    const int h = i / packs, d = (i % packs) * N;
    const T* in = in_token + h * shape.in_strides[1];
    T* to = out_token + h * shape.out_strides[1];
    const auto lo = load<T, N>(in + d), hi = load<T, N>(in + d + half);
    float c_lo[N], c_hi[N], s_lo[N], s_hi[N];
    load_table<T, N>(cos + table + d, c_lo);
    load_table<T, N>(cos + table + d + half, c_hi);
    load_table<T, N>(sin + table + d, s_lo);
    load_table<T, N>(sin + table + d + half, s_hi);
    Pack<T, N> out_lo, out_hi;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float sl = transpose ? -s_hi[k] : s_lo[k], sh = transpose ? -s_lo[k] : s_hi[k];
      const float l = widen(lo.v[k]), r = widen(hi.v[k]);
      out_lo.v[k] = narrow_to<T>(l * c_lo[k] - r * sl);
      out_hi.v[k] = narrow_to<T>(r * c_hi[k] + l * sh);
    }
    store<T, N>(to + d, out_lo);
    store<T, N>(to + d + half, out_hi);
  }
}

// Whether every stride is a whole number of packs of N elements.
template <int N>
bool strides_in_packs(const RotaryShape& shape) {
  for (int i = 0; i < 3; ++i) {
    if (shape.in_strides[i] % N != 0 || shape.out_strides[i] % N != 0) return false;
  }
  return true;
}

// Calls launch(width, blocks) for packs of 16 bytes of T where every pointer allows them and
// every row starts on one (one row, or widths and strides of whole packs), else for single
// elements; blocks spans a row, gridDim.y the rows.
template <typename T, typename Launch>
void launch_packed(int64_t rows, int64_t width, int64_t stride, std::initializer_list<const void*> pointers,
                   Launch launch) {
  constexpr int kPack = 16 / sizeof(T);
  const unsigned grid_rows = static_cast<unsigned>(std::min<int64_t>(rows, 65535));
  if (pack_aligned(pointers) && (rows == 1 || (width % kPack == 0 && stride % kPack == 0))) {
    launch(std::integral_constant<int, kPack>(), dim3(blocks_for((width + kPack - 1) / kPack), grid_rows));
  } else {
    launch(std::integral_constant<int, 1>(), dim3(blocks_for(width), grid_rows));
  }
}

}  // namespace

void swiglu_forward(Element element, int device, const void* gate, const void* up, void* out, int64_t rows,
                    int64_t width, int64_t stride) {
  if (rows == 0 || width == 0) return;
  launch_typed(element, device, [&](auto zero, cudaStream_t stream) {
    using T = decltype(zero);
    const auto* g = static_cast<const T*>(gate);
    const auto* u = static_cast<const T*>(up);
    auto* o = static_cast<T*>(out);
    launch_packed<T>(rows, width, stride, {g, u, o}, [&](auto pack, dim3 blocks) {
      swiglu_forward_kernel<T, decltype(pack)::value><<<blocks, kThreads, 0, stream>>>(g, u, o, rows, width, stride);
    });
  });
}

void swiglu_backward(Element element, int device, const void* grad, const void* gate, const void* up,
                     void* grad_gate, void* grad_up, int64_t rows, int64_t width, int64_t stride) {
  if (rows == 0 || width == 0) return;
  launch_typed(element, device, [&](auto zero, cudaStream_t stream) {
    using T = decltype(zero);
    const auto* dy = static_cast<const T*>(grad);
    const auto* g = static_cast<const T*>(gate);
    const auto* u = static_cast<const T*>(up);
    auto* dg = static_cast<T*>(grad_gate);
    auto* du = static_cast<T*>(grad_up);
    launch_packed<T>(rows, width, stride, {dy, g, u, dg, du}, [&](auto pack, dim3 blocks) {
      swiglu_backward_kernel<T, decltype(pack)::value>
          <<<blocks, kThreads, 0, stream>>>(dy, g, u, dg, du, rows, width, stride);
    });
  });
}

void rotary(Element element, int device, const void* x, const float* cos, const float* sin, void* out,
            const RotaryShape& shape, bool transpose) {
  const int64_t tokens = shape.batch * shape.tokens;
  if (tokens == 0 || shape.heads == 0 || shape.dim == 0) return;
  TORCH_CHECK(tokens <= std::numeric_limits<int32_t>::max(), "fused rotary: ", tokens, " tokens exceed one grid");
  launch_typed(element, device, [&](auto zero, cudaStream_t stream) {
    using T = decltype(zero);
    auto launch = [&](auto width) {
      constexpr int N = decltype(width)::value;
      // A warp at least, as many threads as the token has packs at most.
      const int64_t threads = std::min<int64_t>(kThreads, (shape.heads * (shape.dim / 2 / N) + 31) / 32 * 32);
      rotary_kernel<T, N><<<static_cast<unsigned>(tokens), static_cast<unsigned>(threads), 0, stream>>>(
          static_cast<const T*>(x), cos, sin, static_cast<T*>(out), shape, transpose);
    };
    // 16 bytes of T per load where the halves, the strides, the tables and every pointer allow.
    constexpr int kPack = 16 / sizeof(T);
    if ((shape.dim / 2) % kPack == 0 && strides_in_packs<kPack>(shape) && pack_aligned({x, out, cos, sin})) {
      launch(std::integral_constant<int, kPack>());
    } else {
      launch(std::integral_constant<int, 1>());
    }
  });
}

}  // namespace fsdpp::kernels
