// A whole file mapped read-only into memory; tensors viewing it hold a shared_ptr so the
// mapping outlives them.
#pragma once

#include <cstddef>
#include <filesystem>
#include <memory>

namespace fsdpp {

class MappedFile {
 public:
  // Throws UserError naming the path when it cannot be opened or mapped.
  static std::shared_ptr<MappedFile> open(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  MappedFile(std::filesystem::path path, const std::byte* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}

  std::filesystem::path path_;
  const std::byte* data_;
  size_t size_;
};

// Writes `path` through a temporary file that is fsynced and renamed into place on commit(),
// so a crash leaves either the old file or the new one, never a torn one. Destroyed
// uncommitted, it removes the temporary file.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::filesystem::path path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void append(const void* bytes, size_t size);
  void commit();

 private:
  std::filesystem::path path_, tmp_;
  int fd_ = -1;
};

void write_file_atomically(const std::filesystem::path& path, const void* bytes, size_t size);

}  // namespace fsdpp
