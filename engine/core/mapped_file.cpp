// mmap-backed read-only files and atomic writes.
#include "core/mapped_file.h"

#include "core/checksum.h"
#include "core/error.h"

#include <fcntl.h>
#include <ftw.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

namespace fsdpp {

std::shared_ptr<MappedFile> MappedFile::open(const std::filesystem::path& path) {
  // Non-blocking, so a FIFO in a file's place is refused below instead of waiting forever
  // for a writer; mapping ignores the flag.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw UserError(path.string() + ": cannot open (" + std::strerror(errno) + ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw UserError(path.string() + ": not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* data = nullptr;
  if (size > 0) {
    data = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (data == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      throw UserError(path.string() + ": cannot map (" + std::strerror(err) + ")");
    }
  }
  ::close(fd);
  return std::shared_ptr<MappedFile>(
      new MappedFile(path, static_cast<const std::byte*>(data), size));
}

size_t MappedFile::resident_bytes() const {
  if (size_ == 0) return 0;
  std::ifstream smaps("/proc/self/smaps");
  const auto begin = reinterpret_cast<uintptr_t>(data_);
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    // Mapping lines start "lo-hi perms ..."; attribute lines start with a field name.
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      inside = lo == begin;
    } else if (inside && line.starts_with("Rss:")) {
      return static_cast<size_t>(std::stoull(line.substr(4))) * 1024;  // "Rss:   12 kB"
    }
  }
  return 0;
}

void MappedFile::advise_random() const {
  if (size_ > 0) ::madvise(const_cast<std::byte*>(data_), size_, MADV_RANDOM);
}

MappedFile::~MappedFile() {
  if (size_ > 0) ::munmap(const_cast<std::byte*>(data_), size_);
}

namespace {

// The process's umask now, from /proc/self/status, which reading leaves as it is (umask()
// reads it by setting it, which a thread creating a file meanwhile would see); 022 where the
// kernel does not say.
mode_t process_umask() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.starts_with("Umask:")) return static_cast<mode_t>(std::strtoul(line.c_str() + 6, nullptr, 8));
  }
  return 022;
}

}  // namespace

AtomicFileWriter::AtomicFileWriter(std::filesystem::path path) : path_(std::move(path)) {
  // A name no file had: a file of the user's beside `path` is never written over or removed.
  std::string name = path_.string() + ".tmp-XXXXXX";
  fd_ = ::mkostemp(name.data(), O_CLOEXEC);
  if (fd_ < 0) {
    throw UserError(path_.string() + ": cannot create a temporary file beside it (" + std::strerror(errno) + ")");
  }
  tmp_ = name;
  // mkostemp makes it 0600; the file gets what open(path, 0644) would have given.
  if (::fchmod(fd_, 0644 & ~process_umask()) != 0) {
    const int error = errno;
    ::close(fd_);
    ::unlink(tmp_.c_str());
    fd_ = -1;
    throw UserError(tmp_.string() + ": cannot set its permissions (" + std::strerror(error) + ")");
  }
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFileWriter::append(const void* bytes, size_t size) {
  const auto* p = static_cast<const char*>(bytes);
  crc_ = crc32c(p, size, crc_);
  size_ += size;
  while (size > 0) {
    ssize_t n = ::write(fd_, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw UserError(tmp_.string() + ": write failed (" + std::strerror(errno) + ")");
    p += n;
    size -= static_cast<size_t>(n);
  }
}

void AtomicFileWriter::commit() {
  if (::fsync(fd_) != 0) throw UserError(tmp_.string() + ": fsync failed (" + std::strerror(errno) + ")");
  ::close(fd_);
  fd_ = -1;
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp_.c_str());  // nothing of a write that did not land stays behind
    throw UserError(path_.string() + ": cannot put it in place (" + std::strerror(error) + ")");
  }
}

void remove_tree(const std::filesystem::path& path) {
  auto remove_entry = [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); };
  if (::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0 && errno != ENOENT) {
    throw UserError(path.string() + ": cannot delete (" + std::strerror(errno) + ")");
  }
}

bool path_within(const std::filesystem::path& inner, const std::filesystem::path& outer) {
  const auto a = std::filesystem::weakly_canonical(inner), b = std::filesystem::weakly_canonical(outer);
  const auto [end_b, end_a] = std::mismatch(b.begin(), b.end(), a.begin(), a.end());
  return end_b == b.end();
}

void fsync_directory(const std::filesystem::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw UserError(dir.string() + ": cannot open directory (" + std::strerror(errno) + ")");
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw UserError(dir.string() + ": fsync failed (" + std::strerror(err) + ")");
}

void write_file_atomically(const std::filesystem::path& path, const void* bytes, size_t size) {
  AtomicFileWriter writer(path);
  writer.append(bytes, size);
  writer.commit();
}

void check_replaceable_dir(const std::filesystem::path& dir, const std::string& what,
                           const std::function<bool(const std::string&)>& written) {
  namespace fs = std::filesystem;
  std::error_code error;
  const auto status = fs::status(dir, error);
  if (!fs::exists(status)) return;
  if (!fs::is_directory(status)) {
    throw UserError(dir.string() + ": is a file; " + what + " writes a directory, and replaces only an earlier one");
  }
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (!it->is_regular_file() || !written(name)) {
      throw UserError(dir.string() + ": holds '" + name + "', which " + what + " does not write; " + what +
                      " replaces only an empty directory or an earlier one: choose another directory, or empty this one");
    }
  }
  if (error) throw UserError(dir.string() + ": cannot list it (" + error.message() + ")");
}

std::string file_fingerprint(const MappedFile& file) {
  constexpr size_t kBlocks = 64, kBlock = 4096;
  const size_t size = file.size();
  uint32_t crc = crc32c(&size, sizeof size);
  if (size <= kBlocks * kBlock) return format_crc32c(crc32c(file.data(), size, crc));
  for (size_t i = 0; i < kBlocks; ++i) {
    // Block i starts i / (kBlocks - 1) of the way to the last whole block: the first and the
    // last bytes are always read.
    const size_t at = (size - kBlock) * i / (kBlocks - 1);
    crc = crc32c(file.data() + at, kBlock, crc);
  }
  return format_crc32c(crc);
}

std::string read_text_file(const std::filesystem::path& path) {
  const auto file = MappedFile::open(path);
  return {reinterpret_cast<const char*>(file->data()), file->size()};
}

bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name.size() <= NAME_MAX && name != "." && name != ".." &&
         name.find('/') == std::string::npos && name.find('\0') == std::string::npos;
}

std::filesystem::path file_in_directory(const std::filesystem::path& dir, const std::string& name, Links links) {
  if (!is_plain_file_name(name)) {
    throw UserError("names a file '" + name + "' outside " + dir.string() + " (only plain file names are allowed)");
  }
  const std::filesystem::path path = dir / name;
  auto status = std::filesystem::symlink_status(path);
  if (std::filesystem::is_symlink(status)) {
    if (links == Links::refused) throw UserError("names " + name + ", which is a link (refused)");
    status = std::filesystem::status(path);
    if (!std::filesystem::exists(status)) {
      throw UserError("names " + name + ", a link to " + std::filesystem::read_symlink(path).string() +
                      ", which does not exist");
    }
  }
  if (!std::filesystem::exists(status)) throw UserError("names " + name + ", which is missing from " + dir.string());
  if (!std::filesystem::is_regular_file(status)) throw UserError("names " + name + ", which is not a regular file");
  return path;
}

}  // namespace fsdpp
