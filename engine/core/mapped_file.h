// A whole file mapped read-only into memory; tensors viewing it hold a shared_ptr so the
// mapping outlives them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>

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
  // Bytes of the mapping this process has touched (its resident pages, from
  // /proc/self/smaps): what reading part of the file actually cost.
  size_t resident_bytes() const;
  // Tells the kernel that reads will be scattered: no read-ahead around each fault, so
  // reading a slice brings in little more than the slice's own pages.
  void advise_random() const;

 private:
  MappedFile(std::filesystem::path path, const std::byte* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}

  std::filesystem::path path_;
  const std::byte* data_;
  size_t size_;
};

// Whether a manifest's files may be links: a checkpoint's are the files fsdpp wrote, never
// links; an HF directory's may be, as the hub's download cache links each file to its blob.
enum class Links { refused, followed };

// The file a manifest (checkpoint metadata, an HF index) names in its directory: a plain
// name, no path; a regular file, or with Links::followed a link to one. UserError, to be
// prefixed with the manifest's name, for a name that would leave the directory, a refused or
// dangling link, a missing or a special file.
std::filesystem::path file_in_directory(const std::filesystem::path& dir, const std::string& name,
                                        Links links = Links::refused);

// Whether `name` can only name an entry of its directory: not empty, ".", "..", longer than
// a file name may be, and without a '/' or a NUL (what file_in_directory checks before it
// looks at the disk).
bool is_plain_file_name(const std::string& name);

// Refuses, in one line naming `dir`, a directory that a writer of `what` ("an export", "an
// adapter") may not replace: a file in its place, or a directory holding an entry that is not
// a regular file `written` names. Missing, empty, or an earlier one of its own: it may.
void check_replaceable_dir(const std::filesystem::path& dir, const std::string& what,
                           const std::function<bool(const std::string&)>& written);

// The whole of a regular file as text; UserError naming it when it cannot be read or is not
// a regular file (a FIFO in its place would block a plain read forever).
std::string read_text_file(const std::filesystem::path& path);

// "crc32c:..." of a mapped file's size and of 64 blocks of 4 KiB spread evenly over it (all
// of it when smaller): what tells a file rewritten in place from the one it was, at the cost
// of 64 page reads however large it is.
std::string file_fingerprint(const MappedFile& file);

// Writes `path` through a temporary file of its own (<path>.tmp-XXXXXX) that is fsynced and
// renamed into place on commit(), so a crash leaves either the old file or the new one, never
// a torn one. Destroyed uncommitted, it removes the temporary file.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::filesystem::path path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void append(const void* bytes, size_t size);
  void commit();
  // Bytes appended so far and their CRC-32C, kept as they pass so nothing is read back.
  size_t size() const { return size_; }
  uint32_t checksum() const { return crc_; }

 private:
  std::filesystem::path path_, tmp_;
  int fd_ = -1;
  size_t size_ = 0;
  uint32_t crc_ = 0;
};

void write_file_atomically(const std::filesystem::path& path, const void* bytes, size_t size);

// fsyncs a directory, making the renames and creations inside it durable.
void fsync_directory(const std::filesystem::path& dir);

// Deletes `path` and everything under it, not following symlinks; a missing path is no
// error. (LibTorch's own copy of std::filesystem::remove_all can shadow libstdc++'s and
// crash, so this walks the tree with POSIX calls.)
void remove_tree(const std::filesystem::path& path);

// Whether `inner` is `outer` or lies inside it, once links and ".." are resolved.
bool path_within(const std::filesystem::path& inner, const std::filesystem::path& outer);

}  // namespace fsdpp
