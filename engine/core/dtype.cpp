// Dtype names.
#include "core/dtype.h"

#include "core/config_file.h"
#include "core/error.h"

namespace fsdpp {

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "float32" || name == "fp32") return at::kFloat;
  if (name == "float64" || name == "fp64") return at::kDouble;
  if (name == "bfloat16" || name == "bf16") return at::kBFloat16;
  if (name == "float16" || name == "fp16") return at::kHalf;
  throw UserError("dtype '" + name + "' is not one of float32, float64, bfloat16, float16");
}

at::ScalarType read_dtype(ConfigSection& section, const std::string& key, at::ScalarType fallback) {
  const std::string name = section.get_string(key, dtype_name(fallback));
  try {
    return parse_dtype(name);
  } catch (const UserError& e) {
    section.fail(key, e.what());
  }
}

std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble: return "float64";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default: return "float32";
  }
}

at::ScalarType master_dtype(at::ScalarType dtype) { return dtype == at::kDouble ? at::kDouble : at::kFloat; }

}  // namespace fsdpp
