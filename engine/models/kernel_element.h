// Which element type of the fused CUDA kernels (models/fused_kernels.h) a tensor holds: one
// for float32, bf16 and fp16 in GPU memory, none for anything else.
#pragma once

#include "models/fused_kernels.h"

#include <ATen/core/Tensor.h>

#include <optional>

namespace fsdpp {

inline std::optional<kernels::Element> kernel_element(const at::Tensor& t) {
  if (!t.is_cuda()) return std::nullopt;
  switch (t.scalar_type()) {
    case at::kFloat:
      return kernels::Element::kFloat;
    case at::kBFloat16:
      return kernels::Element::kBFloat16;
    case at::kHalf:
      return kernels::Element::kHalf;
    default:
      return std::nullopt;
  }
}

}  // namespace fsdpp
