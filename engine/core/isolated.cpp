// fork, a pipe read under poll() until end-of-file or the deadline, SIGKILL past it.
#include "core/isolated.h"

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>
#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

namespace fsdpp {

namespace {

// The child's report: one status byte ('+' returned, '!' threw), then the text.
void write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

// Caps the address space at its present size plus `growth_bytes`.
void limit_growth(size_t growth_bytes) {
  size_t pages = 0;  // statm's first field: the address space's size in pages
  if (std::FILE* statm = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(statm, "%zu", &pages) != 1) pages = 0;
    std::fclose(statm);
  }
  if (pages == 0) return;  // unknown: no cap rather than one below what is mapped already
  const rlim_t cap = static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE)) + growth_bytes;
  const rlimit limit{cap, cap};
  ::setrlimit(RLIMIT_AS, &limit);
}

[[noreturn]] void run_child(int fd, const std::function<std::string()>& body, size_t growth_bytes) {
  if (growth_bytes > 0) limit_growth(growth_bytes);
  std::string report;
  try {
    report = "+" + body();
  } catch (const std::bad_alloc&) {
    report = "!out of memory: past the " + std::to_string(growth_bytes >> 20) + " MiB it may take";
  } catch (const std::exception& e) {
    report = std::string("!") + e.what();
  } catch (...) {
    report = "!unknown failure";
  }
  write_all(fd, report);
  // No exit handlers or destructors: they belong to the parent's copy of the process.
  ::_exit(0);
}

// Reads until end-of-file; false when the deadline passed first.
bool read_until_eof(int fd, std::chrono::steady_clock::time_point deadline, std::string& out) {
  char buffer[65536];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1 << 30)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;  // re-checks the deadline
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return true;
    out.append(buffer, static_cast<size_t>(n));
  }
}

}  // namespace

IsolatedResult run_isolated(const std::function<std::string()>& body, std::chrono::milliseconds deadline,
                            size_t growth_bytes) {
  IsolatedResult result;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {  // no other child of this process inherits the pipe
    result.end = IsolatedResult::End::failed;
    result.output = std::string("cannot create a pipe: ") + std::strerror(errno);
    return result;
  }
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(fds[0]);
    run_child(fds[1], body, growth_bytes);
  }
  ::close(fds[1]);
  if (child < 0) {
    ::close(fds[0]);
    result.end = IsolatedResult::End::failed;
    result.output = std::string("cannot start a process: ") + std::strerror(errno);
    return result;
  }
  std::string report;
  const bool in_time = read_until_eof(fds[0], std::chrono::steady_clock::now() + deadline, report);
  ::close(fds[0]);
  if (!in_time) ::kill(child, SIGKILL);
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  if (!in_time) {
    result.end = IsolatedResult::End::timed_out;
  } else if (!report.empty()) {
    result.end = report[0] == '+' ? IsolatedResult::End::finished : IsolatedResult::End::failed;
    result.output = report.substr(1);
  } else {
    result.end = IsolatedResult::End::died;
    result.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  }
  return result;
}

}  // namespace fsdpp
