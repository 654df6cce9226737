// The fused cross entropy kernels (see cross_entropy_kernel.h). One block of threads per row:
// each thread keeps a running log-sum-exp over its strided share of the row (16-byte packs
// where the row allows), and the block merges them.
#include "loss/cross_entropy_kernel.h"

#include "models/kernel_common.cuh"

#include <c10/macros/Macros.h>

#include <cmath>
#include <type_traits>

namespace fsdpp::kernels {

namespace {

// A log-sum-exp in progress: the largest value seen and the sum of exp(value - max). A value
// of -inf adds nothing; a NaN makes the sum NaN, as it makes ATen's.
struct Running {
  float max;
  float sum;
};

__device__ void add(Running& r, float x) {
  if (x > r.max) {
    r.sum = r.sum * expf(r.max - x) + 1.0f;  // exp(-inf) = 0 while nothing larger than -inf was seen
    r.max = x;
  } else if (x != -INFINITY) {
    r.sum += expf(x - r.max);
  }
}

__device__ void merge(Running& r, Running other) {
  if (other.max > r.max) {
    r.sum = r.sum * expf(r.max - other.max) + other.sum;
    r.max = other.max;
  } else if (other.sum != 0.0f) {  // NaN included, which a share of NaNs holds at max -inf
    r.sum += other.sum * expf(other.max - r.max);
  }
}

__device__ Running merge_warp(Running r) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    merge(r, Running{__shfl_xor_sync(0xffffffffu, r.max, offset), __shfl_xor_sync(0xffffffffu, r.sum, offset)});
  }
  return r;
}

// The whole block's log-sum-exp, valid in thread 0.
__device__ float block_log_sum_exp(Running r) {
  __shared__ Running shares[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  r = merge_warp(r);
  if (lane == 0) shares[warp] = r;
  __syncthreads();
  if (warp != 0) return 0.0f;
  r = merge_warp(lane < kWarps ? shares[lane] : Running{-INFINITY, 0.0f});
  // A +inf logit makes ATen's log-softmax NaN (inf - inf), and so the loss and the gradient.
  return r.max == INFINITY ? NAN : r.max + logf(r.sum);
}

// Calls op(first) for the first element of each pack of N elements of a row that this thread owns.
template <int N, typename Op>
__device__ void for_row_packs(int64_t vocab, Op op) {
  for (int64_t first = static_cast<int64_t>(threadIdx.x) * N; first < vocab; first += static_cast<int64_t>(kThreads) * N) {
    op(first);
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads) cross_entropy_forward_kernel(const T* logits, const int64_t* targets,
                                                                         int64_t ignore, float* loss, float* lse,
                                                                         int64_t vocab) {
  const int64_t row = blockIdx.x;
  const int64_t target = targets[row];
  if (target == ignore) {  // the whole block leaves together
    if (threadIdx.x == 0) loss[row] = lse[row] = 0.0f;
    return;
  }
  CUDA_KERNEL_ASSERT(target >= 0 && target < vocab);
  const T* x = logits + row * vocab;
  Running r{-INFINITY, 0.0f};
  for_row_packs<N>(vocab, [&](int64_t first) {
    const auto pack = *reinterpret_cast<const Pack<T, N>*>(x + first);
#pragma unroll
    for (int i = 0; i < N; ++i) add(r, widen(pack.v[i]));
  });
  const float row_lse = block_log_sum_exp(r);
  if (threadIdx.x == 0) {
    lse[row] = row_lse;
    loss[row] = row_lse - widen(x[target]);
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads) cross_entropy_backward_kernel(const T* logits, const int64_t* targets,
                                                                          int64_t ignore, const float* lse,
                                                                          const float* grad_loss, T* grad,
                                                                          int64_t vocab) {
  const int64_t row = blockIdx.x;
  const int64_t target = targets[row];
  const bool ignored = target == ignore;
  // An ignored row's gradient is zero whatever its incoming gradient holds (inf or NaN too).
  const float scale = ignored ? 0.0f : grad_loss[row], row_lse = lse[row];
  const T* x = logits + row * vocab;
  T* dx = grad + row * vocab;
  for_row_packs<N>(vocab, [&](int64_t first) {
    const auto pack = *reinterpret_cast<const Pack<T, N>*>(x + first);
    Pack<T, N> out;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float p = expf(widen(pack.v[i]) - row_lse) - (first + i == target ? 1.0f : 0.0f);
      out.v[i] = narrow_to<T>(ignored ? 0.0f : p * scale);
    }
    *reinterpret_cast<Pack<T, N>*>(dx + first) = out;
  });
}

unsigned row_blocks(int64_t rows) {
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max(), "fused cross entropy: ", rows, " rows exceed one grid");
  return static_cast<unsigned>(rows);
}

}  // namespace

void cross_entropy_forward(Element element, int device, const void* logits, const int64_t* targets, int64_t ignore,
                           float* loss, float* lse, int64_t rows, int64_t vocab) {
  if (rows == 0) return;
  launch_typed(element, device, [&](auto zero, cudaStream_t stream) {
    using T = decltype(zero);
    const auto* x = static_cast<const T*>(logits);
    launch_rows<T>(vocab, {x}, [&](auto width) {
      cross_entropy_forward_kernel<T, decltype(width)::value>
          <<<row_blocks(rows), kThreads, 0, stream>>>(x, targets, ignore, loss, lse, vocab);
    });
  });
}

void cross_entropy_backward(Element element, int device, const void* logits, const int64_t* targets, int64_t ignore,
                            const float* lse, const float* grad_loss, void* grad_logits, int64_t rows, int64_t vocab) {
  if (rows == 0) return;
  launch_typed(element, device, [&](auto zero, cudaStream_t stream) {
    using T = decltype(zero);
    const auto* x = static_cast<const T*>(logits);
    auto* dx = static_cast<T*>(grad_logits);
    launch_rows<T>(vocab, {x, dx}, [&](auto width) {
      cross_entropy_backward_kernel<T, decltype(width)::value>
          <<<row_blocks(rows), kThreads, 0, stream>>>(x, targets, ignore, lse, grad_loss, dx, vocab);
    });
  });
}

}  // namespace fsdpp::kernels
