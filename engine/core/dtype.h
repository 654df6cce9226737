// Floating dtypes by name, as configs and policies spell them.
#pragma once

#include <c10/core/ScalarType.h>

#include <string>

namespace fsdpp {

class ConfigSection;

// "float32"/"fp32", "float64"/"fp64", "bfloat16"/"bf16", "float16"/"fp16"; UserError for
// anything else.
at::ScalarType parse_dtype(const std::string& name);
// The dtype `key` of a config section names (`fallback` when absent); any other name fails
// with the file, line and key.
at::ScalarType read_dtype(ConfigSection& section, const std::string& key, at::ScalarType fallback);
// The long name: "float32", "float64", "bfloat16", "float16".
std::string dtype_name(at::ScalarType dtype);
// The dtype master shards, optimizer state and reductions keep for parameters of `dtype`:
// float32, or float64 for a float64 model (whose runs are then exact to float64 rounding).
at::ScalarType master_dtype(at::ScalarType dtype);

}  // namespace fsdpp
