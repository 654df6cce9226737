// Reading and writing the safetensors format: the header (io/safetensors_header.h), then
// the raw data.
#pragma once

#include "core/mapped_file.h"
#include "io/safetensors_header.h"

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fsdpp {

class SafetensorsFile {
 public:
  using Entry = SafetensorsEntry;

  // Maps the file and validates the whole header (lengths, dtypes, shapes, offsets); any
  // fault is a UserError naming the file and, where it applies, the tensor.
  static std::shared_ptr<SafetensorsFile> open(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return file_->path(); }
  const std::map<std::string, Entry>& entries() const { return header_.entries; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  bool contains(const std::string& name) const { return header_.entries.count(name) != 0; }
  size_t resident_bytes() const { return file_->resident_bytes(); }
  void advise_random() const { file_->advise_random(); }
  // file_fingerprint of the mapping: what tells the file rewritten in place.
  std::string fingerprint() const { return file_fingerprint(*file_); }

  // A read-only CPU view into the mapping (never write through it); keeps the file mapped.
  at::Tensor tensor(const std::string& name) const;

 private:
  std::shared_ptr<MappedFile> file_;
  SafetensorsHeader header_;
};

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

struct TensorSpec {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;

  size_t bytes() const;
};

// Streams a safetensors file one tensor at a time, in the order of `specs` (the header,
// which lists every tensor's byte range, is written first), so a writer never holds more
// than one tensor. The file appears atomically on commit().
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::filesystem::path& path, std::vector<TensorSpec> specs,
                    const std::map<std::string, std::string>& metadata = {});

  // The next spec's values (any device or floating dtype; converted to the spec's dtype).
  void write(const at::Tensor& tensor);
  // Checks that every tensor was written, then fsyncs and renames the file into place.
  void commit();
  size_t size() const { return file_.size(); }
  uint32_t checksum() const { return file_.checksum(); }

 private:
  AtomicFileWriter file_;
  std::vector<TensorSpec> specs_;
  size_t next_ = 0;
};

// Writes tensors (any device, made contiguous on the CPU) atomically.
void write_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace fsdpp
