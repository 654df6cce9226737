// Parsing and validating safetensors headers.
#include "io/safetensors_header.h"

#include "core/error.h"
#include "core/json_text.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <utility>

namespace fsdpp {

namespace {

using nlohmann::json;

constexpr size_t kMaxHeaderBytes = 100u << 20;

const std::vector<std::pair<std::string, at::ScalarType>>& dtype_table() {
  static const std::vector<std::pair<std::string, at::ScalarType>> table = {
      {"F64", at::kDouble}, {"F32", at::kFloat},   {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},     {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool}};
  return table;
}

// One tensor's entry, checked against the `data_size` bytes of the data section.
SafetensorsEntry parse_entry(const json& value, size_t data_size, const std::string& where) {
  if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") ||
      !value.contains("data_offsets") || !value["dtype"].is_string() || !value["shape"].is_array() ||
      !value["data_offsets"].is_array() || value["data_offsets"].size() != 2) {
    throw UserError(where + ": corrupt header entry (needs dtype, shape, data_offsets)");
  }
  SafetensorsEntry entry;
  entry.dtype = safetensors_dtype(value["dtype"].get<std::string>(), where);
  // The element count in checked arithmetic: a shape whose product wraps around would
  // otherwise match a small byte range.
  uint64_t numel = 1;
  bool overflow = false, empty = false;
  for (const auto& dim : value["shape"]) {
    if (!dim.is_number_unsigned() || dim.get<uint64_t>() > (uint64_t{1} << 48)) {
      throw UserError(where + ": corrupt shape " + value["shape"].dump());
    }
    entry.shape.push_back(dim.get<int64_t>());
    empty = empty || dim.get<uint64_t>() == 0;
    overflow = __builtin_mul_overflow(numel, dim.get<uint64_t>(), &numel) || overflow;
  }
  uint64_t expected = 0;
  if (!empty && (overflow || __builtin_mul_overflow(numel, c10::elementSize(entry.dtype), &expected))) {
    throw UserError(where + ": shape " + value["shape"].dump() + " holds more elements than any file can");
  }
  for (const auto& off : value["data_offsets"]) {
    if (!off.is_number_unsigned()) throw UserError(where + ": corrupt data_offsets");
  }
  entry.begin = value["data_offsets"][0].get<size_t>();
  entry.end = value["data_offsets"][1].get<size_t>();
  if (entry.end < entry.begin || entry.end - entry.begin != expected) {
    throw UserError(where + ": data_offsets span " + std::to_string(entry.end - std::min(entry.begin, entry.end)) +
                    " bytes but the shape needs " + std::to_string(expected));
  }
  if (entry.end > data_size) throw UserError(where + ": data runs past the end of the file (truncated?)");
  return entry;
}

// The tensors' byte ranges cover the data section exactly, end to end, as the format's writers
// lay them out: a gap or bytes after the last tensor are the sign of a file cut or spliced,
// and an overlap would alias two tensors.
void check_ranges_tile(std::vector<std::pair<size_t, size_t>> ranges, size_t data_size, const std::string& where) {
  std::sort(ranges.begin(), ranges.end());
  size_t covered = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin < covered) throw UserError(where + ": corrupt safetensors header (tensor byte ranges overlap)");
    if (begin > covered) {
      throw UserError(where + ": corrupt safetensors header (bytes " + std::to_string(covered) + ".." +
                      std::to_string(begin) + " of the data section belong to no tensor)");
    }
    covered = end;
  }
  if (covered != data_size) {
    throw UserError(where + ": corrupt safetensors file (" + std::to_string(data_size - covered) +
                    " bytes after the last tensor's data)");
  }
}

}  // namespace

std::string safetensors_dtype_name(at::ScalarType dtype) {
  for (const auto& [name, type] : dtype_table()) {
    if (type == dtype) return name;
  }
  throw UserError(std::string("dtype ") + c10::toString(dtype) + " cannot be stored in safetensors");
}

at::ScalarType safetensors_dtype(const std::string& name, const std::string& origin) {
  for (const auto& [n, type] : dtype_table()) {
    if (n == name) return type;
  }
  throw UserError(origin + ": unsupported dtype '" + name + "'");
}

SafetensorsHeader SafetensorsHeader::parse(const std::byte* data, size_t size, const std::string& where) {
  if (size < 8) throw UserError(where + ": corrupt safetensors file (shorter than its 8-byte header length)");
  uint64_t header_len = 0;
  std::memcpy(&header_len, data, 8);
  if (header_len > size - 8) {
    throw UserError(where + ": corrupt safetensors header (its length " + std::to_string(header_len) +
                    " exceeds the " + std::to_string(size - 8) + " bytes after the 8 that give it)");
  }
  if (header_len > kMaxHeaderBytes) {
    throw UserError(where + ": corrupt safetensors header (its length " + std::to_string(header_len) +
                    " is past the " + std::to_string(kMaxHeaderBytes >> 20) + " MiB a header may take)");
  }
  const json header = parse_json({reinterpret_cast<const char*>(data) + 8, header_len}, where + ": corrupt safetensors header");
  if (!header.is_object()) throw UserError(where + ": corrupt safetensors header (not a JSON object)");
  SafetensorsHeader result;
  result.data_offset = 8 + header_len;
  std::vector<std::pair<size_t, size_t>> ranges;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) throw UserError(where + ": corrupt safetensors header (__metadata__ is not an object)");
      for (const auto& [k, v] : value.items()) {
        if (v.is_string()) result.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    SafetensorsEntry entry = parse_entry(value, size - result.data_offset, where + ": tensor '" + name + "'");
    ranges.emplace_back(entry.begin, entry.end);
    result.entries.emplace(name, std::move(entry));
  }
  check_ranges_tile(std::move(ranges), size - result.data_offset, where);
  return result;
}

}  // namespace fsdpp
