// safetensors reader (mmap, zero-copy) and writer.
#include "io/safetensors.h"

#include "core/error.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>

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

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::filesystem::path& path) {
  auto result = std::make_shared<SafetensorsFile>();
  result->file_ = MappedFile::open(path);
  const auto& file = *result->file_;
  const std::string where = path.string();
  if (file.size() < 8) throw UserError(where + ": corrupt safetensors file (shorter than its 8-byte header length)");
  uint64_t header_len = 0;
  std::memcpy(&header_len, file.data(), 8);
  if (header_len > kMaxHeaderBytes || header_len > file.size() - 8) {
    throw UserError(where + ": corrupt safetensors header (length " + std::to_string(header_len) +
                    " exceeds the file's " + std::to_string(file.size()) + " bytes)");
  }
  json header;
  try {
    header = json::parse(reinterpret_cast<const char*>(file.data()) + 8,
                         reinterpret_cast<const char*>(file.data()) + 8 + header_len);
  } catch (const json::parse_error& e) {
    throw UserError(where + ": corrupt safetensors header (not valid JSON: " + e.what() + ")");
  }
  if (!header.is_object()) throw UserError(where + ": corrupt safetensors header (not a JSON object)");
  result->data_offset_ = 8 + header_len;
  const size_t data_size = file.size() - result->data_offset_;
  std::vector<std::pair<size_t, size_t>> ranges;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) throw UserError(where + ": corrupt safetensors header (__metadata__ is not an object)");
      for (const auto& [k, v] : value.items()) {
        if (v.is_string()) result->metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string tensor_where = where + ": tensor '" + name + "'";
    if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") ||
        !value.contains("data_offsets") || !value["dtype"].is_string() ||
        !value["shape"].is_array() || !value["data_offsets"].is_array() ||
        value["data_offsets"].size() != 2) {
      throw UserError(tensor_where + ": corrupt header entry (needs dtype, shape, data_offsets)");
    }
    Entry entry;
    entry.dtype = safetensors_dtype(value["dtype"].get<std::string>(), tensor_where);
    // The element count in checked arithmetic: a shape whose product wraps around would
    // otherwise match a small byte range.
    uint64_t numel = 1;
    bool overflow = false, empty = false;
    for (const auto& dim : value["shape"]) {
      if (!dim.is_number_unsigned() || dim.get<uint64_t>() > (uint64_t{1} << 48)) {
        throw UserError(tensor_where + ": corrupt shape " + value["shape"].dump());
      }
      entry.shape.push_back(dim.get<int64_t>());
      empty = empty || dim.get<uint64_t>() == 0;
      overflow = __builtin_mul_overflow(numel, dim.get<uint64_t>(), &numel) || overflow;
    }
    uint64_t expected = 0;
    if (!empty && (overflow || __builtin_mul_overflow(numel, c10::elementSize(entry.dtype), &expected))) {
      throw UserError(tensor_where + ": shape " + value["shape"].dump() + " holds more elements than any file can");
    }
    for (const auto& off : value["data_offsets"]) {
      if (!off.is_number_unsigned()) throw UserError(tensor_where + ": corrupt data_offsets");
    }
    entry.begin = value["data_offsets"][0].get<size_t>();
    entry.end = value["data_offsets"][1].get<size_t>();
    if (entry.end < entry.begin || entry.end - entry.begin != expected) {
      throw UserError(tensor_where + ": data_offsets span " +
                      std::to_string(entry.end - std::min(entry.begin, entry.end)) +
                      " bytes but the shape needs " + std::to_string(expected));
    }
    if (entry.end > data_size) {
      throw UserError(tensor_where + ": data runs past the end of the file (truncated?)");
    }
    ranges.emplace_back(entry.begin, entry.end);
    result->entries_.emplace(name, std::move(entry));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      throw UserError(where + ": corrupt safetensors header (tensor byte ranges overlap)");
    }
  }
  return result;
}

at::Tensor SafetensorsFile::tensor(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) throw UserError(path().string() + ": missing tensor '" + name + "'");
  const Entry& e = it->second;
  auto keep_alive = file_;
  void* data = const_cast<std::byte*>(file_->data() + data_offset_ + e.begin);
  return at::from_blob(data, e.shape, [keep_alive](void*) {}, at::TensorOptions().dtype(e.dtype));
}

size_t TensorSpec::bytes() const {
  size_t n = c10::elementSize(dtype);
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

SafetensorsWriter::SafetensorsWriter(const std::filesystem::path& path, std::vector<TensorSpec> specs,
                                     const std::map<std::string, std::string>& metadata)
    : file_(path), specs_(std::move(specs)) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& spec : specs_) {
    header[spec.name] = {{"dtype", safetensors_dtype_name(spec.dtype)},
                         {"shape", spec.shape},
                         {"data_offsets", {offset, offset + spec.bytes()}}};
    offset += spec.bytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data section 8-byte aligned
  const uint64_t header_len = text.size();
  file_.append(&header_len, 8);
  file_.append(text.data(), text.size());
}

void SafetensorsWriter::write(const at::Tensor& tensor) {
  TORCH_CHECK(next_ < specs_.size(), "safetensors writer: more tensors than specs");
  const TensorSpec& spec = specs_[next_++];
  TORCH_CHECK(tensor.sizes().vec() == spec.shape, "safetensors writer: tensor '", spec.name, "' has shape ",
              tensor.sizes(), ", its spec ", c10::IntArrayRef(spec.shape));
  const at::Tensor host = tensor.detach().to(at::kCPU, spec.dtype).contiguous();
  file_.append(host.data_ptr(), spec.bytes());
}

void SafetensorsWriter::commit() {
  TORCH_CHECK(next_ == specs_.size(), "safetensors writer: ", specs_.size() - next_, " tensors never written");
  file_.commit();
}

void write_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  SafetensorsWriter writer(path, std::move(specs), metadata);
  for (const auto& [name, t] : tensors) writer.write(t);
  writer.commit();
}

}  // namespace fsdpp
