// Which element type of the fused CUDA kernels (models/fused_kernels.h) a tensor holds: one
// for float32, bf16 and fp16 in GPU memory, none for anything else; and how a launch of one
// is named to operator observers.
#pragma once

#include "models/fused_kernels.h"

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>

#include <optional>
#include <vector>

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

// Names a fused kernel's launch, with the tensors it reads and writes, to whatever observes
// operators (the kernel count of metrics/op_count, the profiler): at the call site,
//   at::RecordFunction record(at::RecordScope::FUNCTION);
//   if (record.isActive()) describe_kernel(record, "fsdpp::rotary", {x, cos, sin}, {out});
// so that the lists are built only while something observes. Observers read the inputs as
// the record begins, inside this call.
inline void describe_kernel(at::RecordFunction& record, const char* name, const std::vector<c10::IValue>& reads,
                            const std::vector<c10::IValue>& writes) {
  if (record.needsInputs()) {
    record.before(name, &reads);
  } else {
    record.before(name);
  }
  if (record.needsOutputs()) record.setOutputs(writes);
}

}  // namespace fsdpp
