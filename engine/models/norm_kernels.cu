// The residual add and the RMSNorm after it, one kernel each way (see fused_kernels.h). A
// block of threads takes one row at a time: thread t owns the same columns of every row (16-
// byte packs where every pointer and the width allow, else single elements), so its share of
// the weight's gradient accumulates in shared memory without races or atomics, and the row's
// one sum crosses the block through shared memory in a fixed order (the same result on every
// run of one device). The shared accumulators are laid out element-of-pack major, so that
// neighbouring threads touch neighbouring banks.
#include "models/fused_kernels.h"

#include "models/kernel_common.cuh"

#include <algorithm>

namespace fsdpp::kernels {

namespace {

struct Sum {
  __device__ float operator()(float a, float b) const { return a + b; }
};

// The sum of every thread's `value`, in every thread. `scratch` holds kWarps floats.
__device__ float block_sum(float value, float* scratch) { return block_reduce(value, scratch, Sum()); }

template <typename T, int N>
__global__ void add_rms_norm_forward_kernel(const T* x, const T* delta, const T* weight, T* sum, T* out,
                                            float* rstd, int64_t rows, int64_t width, float eps) {
  __shared__ float scratch[kWarps];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * width;
    float squares = 0.0f;
    for (int64_t c = threadIdx.x * N; c < width; c += kThreads * N) {
      const auto a = load<T, N>(x + base + c), b = load<T, N>(delta + base + c);
      Pack<T, N> h;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        h.v[i] = narrow_to<T>(widen(a.v[i]) + widen(b.v[i]));
        const float v = widen(h.v[i]);  // the norm reads the sum as rounded, as an unfused add leaves it
        squares += v * v;
      }
      store<T, N>(sum + base + c, h);
    }
    const float r = rsqrtf(block_sum(squares, scratch) / static_cast<float>(width) + eps);
    // Each thread reads back only the columns it wrote.
    for (int64_t c = threadIdx.x * N; c < width; c += kThreads * N) {
      const auto h = load<T, N>(sum + base + c), w = load<T, N>(weight + c);
      Pack<T, N> y;
#pragma unroll
      for (int i = 0; i < N; ++i) y.v[i] = narrow_to<T>(widen(h.v[i]) * r * widen(w.v[i]));
      store<T, N>(out + base + c, y);
    }
    if (threadIdx.x == 0) rstd[row] = r;
  }
}

// With n = sum * rstd and g = grad_out * weight, the norm's gradient of the sum is
// rstd * (g - n * mean(g * n)).
template <typename T, int N>
__global__ void add_rms_norm_backward_kernel(const T* grad_out, const T* grad_sum, const T* sum, const T* weight,
                                             const float* rstd, T* grad_x, float* weight_partials, int64_t rows,
                                             int64_t width) {
  extern __shared__ float shared[];
  float* scratch = shared;  // [kWarps]
  // [N, width / N]: column c + i of pack c at [i][c / N], touched by its owning thread alone.
  float* weight_grad = shared + kWarps;
  const int64_t packs = width / N;
  const bool weight_trains = weight_partials != nullptr;
  for (int64_t c = threadIdx.x * N; c < width && weight_trains; c += kThreads * N) {
#pragma unroll
    for (int i = 0; i < N; ++i) weight_grad[i * packs + c / N] = 0.0f;
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * width;
    const float r = rstd[row];
    float dot = 0.0f;
    for (int64_t c = threadIdx.x * N; c < width; c += kThreads * N) {
      const auto dy = load<T, N>(grad_out + base + c), h = load<T, N>(sum + base + c), w = load<T, N>(weight + c);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const float n = widen(h.v[i]) * r, d = widen(dy.v[i]);
        dot += d * widen(w.v[i]) * n;
        if (weight_trains) weight_grad[i * packs + c / N] += d * n;
      }
    }
    const float mean = block_sum(dot, scratch) / static_cast<float>(width);
    for (int64_t c = threadIdx.x * N; c < width; c += kThreads * N) {
      const auto dy = load<T, N>(grad_out + base + c), h = load<T, N>(sum + base + c), w = load<T, N>(weight + c);
      Pack<T, N> gs;
      if (grad_sum != nullptr) gs = load<T, N>(grad_sum + base + c);
      Pack<T, N> dx;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const float n = widen(h.v[i]) * r;
        const float through_norm = r * (widen(dy.v[i]) * widen(w.v[i]) - n * mean);
        dx.v[i] = narrow_to<T>(grad_sum != nullptr ? through_norm + widen(gs.v[i]) : through_norm);
      }
      store<T, N>(grad_x + base + c, dx);
    }
  }
  if (!weight_trains) return;
  for (int64_t c = threadIdx.x * N; c < width; c += kThreads * N) {
#pragma unroll
    for (int i = 0; i < N; ++i) weight_partials[blockIdx.x * width + c + i] = weight_grad[i * packs + c / N];
  }
}

void check_width(int64_t width) {
  TORCH_CHECK(width > 0 && width <= kMaxNormWidth, "residual RMSNorm kernel: rows of ", width,
              " elements, where it takes 1 to ", kMaxNormWidth);
}

}  // namespace

void add_rms_norm_forward(Element element, int device, const void* x, const void* delta, const void* weight,
                          void* sum, void* out, float* rstd, int64_t rows, int64_t width, float eps) {
  if (rows == 0) return;
  check_width(width);
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(rows, std::numeric_limits<int32_t>::max()));
  launch_typed(element, device, [&](auto zero, cudaStream_t stream) {
    using T = decltype(zero);
    const auto* a = static_cast<const T*>(x);
    const auto* b = static_cast<const T*>(delta);
    const auto* w = static_cast<const T*>(weight);
    auto* s = static_cast<T*>(sum);
    auto* y = static_cast<T*>(out);
    launch_rows<T>(width, {a, b, w, s, y}, [&](auto pack) {
      add_rms_norm_forward_kernel<T, decltype(pack)::value>
          <<<blocks, kThreads, 0, stream>>>(a, b, w, s, y, rstd, rows, width, eps);
    });
  });
}

int add_rms_norm_backward_blocks(int device, int64_t rows) {
  int processors = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&processors, cudaDevAttrMultiProcessorCount, device));
  // Four blocks per multiprocessor keep its memory pipes busy; each block's partial row of
  // the weight's gradient is one more row for the final sum to read.
  return static_cast<int>(std::min<int64_t>(rows, 4 * static_cast<int64_t>(processors)));
}

void add_rms_norm_backward(Element element, int device, const void* grad_out, const void* grad_sum,
                           const void* sum, const void* weight, const float* rstd, void* grad_x,
                           float* weight_partials, int64_t rows, int64_t width) {
  if (rows == 0) return;
  check_width(width);
  const auto blocks = static_cast<unsigned>(add_rms_norm_backward_blocks(device, rows));
  const size_t shared_bytes = (kWarps + width) * sizeof(float);
  launch_typed(element, device, [&](auto zero, cudaStream_t stream) {
    using T = decltype(zero);
    const auto* dy = static_cast<const T*>(grad_out);
    const auto* gs = static_cast<const T*>(grad_sum);
    const auto* h = static_cast<const T*>(sum);
    const auto* w = static_cast<const T*>(weight);
    auto* dx = static_cast<T*>(grad_x);
    // A missing grad_sum reads nothing, so it does not decide the packing.
    launch_rows<T>(width, {dy, gs == nullptr ? dy : gs, h, w, dx}, [&](auto pack) {
      add_rms_norm_backward_kernel<T, decltype(pack)::value>
          <<<blocks, kThreads, shared_bytes, stream>>>(dy, gs, h, w, rstd, dx, weight_partials, rows, width);
    });
  });
}

}  // namespace fsdpp::kernels
