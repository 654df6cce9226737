// The header of a safetensors file: an 8-byte little-endian length, then a JSON object
// giving each tensor's dtype, shape and byte range in the data section that follows it.
// Parsed from bytes without the rest of LibTorch, so the parser can be fuzzed on its own.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdpp {

struct SafetensorsEntry {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  size_t begin = 0;  // byte range in the data section
  size_t end = 0;
};

struct SafetensorsHeader {
  size_t data_offset = 0;  // where the data section starts in the file
  std::map<std::string, SafetensorsEntry> entries;
  std::map<std::string, std::string> metadata;  // __metadata__'s string values

  // Validates the header of a whole file (`size` bytes at `data`): its length, every dtype
  // and shape (element counts in checked arithmetic), byte ranges that match their shapes
  // and cover the data section end to end, with no gap, overlap or bytes left over, and no
  // tensor named twice. Any fault is a UserError starting with `where`
  // and naming the tensor where one is at fault.
  static SafetensorsHeader parse(const std::byte* data, size_t size, const std::string& where);
};

// "F32", "BF16", ... for a dtype, and back (UserError for a name the format lacks).
std::string safetensors_dtype_name(at::ScalarType dtype);
at::ScalarType safetensors_dtype(const std::string& name, const std::string& origin);

}  // namespace fsdpp
