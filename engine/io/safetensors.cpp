// safetensors reader (mmap, zero-copy) and writer.
#include "io/safetensors.h"

#include "core/dtype.h"
#include "core/error.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

namespace fsdpp {

using nlohmann::json;

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::filesystem::path& path) {
  auto result = std::make_shared<SafetensorsFile>();
  result->file_ = MappedFile::open(path);
  result->header_ = SafetensorsHeader::parse(result->file_->data(), result->file_->size(), path.string());
  return result;
}

at::Tensor SafetensorsFile::tensor(const std::string& name) const {
  auto it = header_.entries.find(name);
  if (it == header_.entries.end()) throw UserError(path().string() + ": missing tensor '" + name + "'");
  const Entry& e = it->second;
  auto keep_alive = file_;
  void* data = const_cast<std::byte*>(file_->data() + header_.data_offset + e.begin);
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
  // A narrower dtype's rounding is the writer's to accept; its overflow to inf is lost data.
  if (spec.dtype != tensor.scalar_type() && at::isFloatingType(spec.dtype) &&
      (at::isinf(host) & at::isfinite(tensor.detach()).to(at::kCPU)).any().item<bool>()) {
    const double largest = tensor.detach().abs().nan_to_num(0, 0, 0).max().item<double>();
    throw UserError("tensor '" + spec.name + "' holds values as large as " + c10::str(largest) + ", past " +
                    dtype_name(spec.dtype) + "'s range: write it in a wider dtype");
  }
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
