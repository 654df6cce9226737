// Floating dtypes by name, as configs and policies spell them.
#pragma once

#include <c10/core/ScalarType.h>

#include <string>

namespace fsdpp {

// "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16"; UserError for anything else.
at::ScalarType parse_dtype(const std::string& name);
// The long name: "float32", "bfloat16", "float16".
std::string dtype_name(at::ScalarType dtype);

}  // namespace fsdpp
