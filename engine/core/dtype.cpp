// Dtype names.
#include "core/dtype.h"

#include "core/error.h"

namespace fsdpp {

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "float32" || name == "fp32") return at::kFloat;
  if (name == "bfloat16" || name == "bf16") return at::kBFloat16;
  if (name == "float16" || name == "fp16") return at::kHalf;
  throw UserError("dtype '" + name + "' is not one of float32, bfloat16, float16");
}

std::string dtype_name(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? "bfloat16" : dtype == at::kHalf ? "float16" : "float32";
}

}  // namespace fsdpp
