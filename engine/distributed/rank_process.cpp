// fork/exec with two pipes, non-blocking reads, and waitpid(WNOHANG).
#include "distributed/rank_process.h"

#include "core/error.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>

namespace fsdpp {

namespace {

// A rank's closing lines, kept for the launcher's one report instead of printed: its user
// error, or the failure it ended on (often a collective that lost a peer).
constexpr std::string_view kErrorPrefixes[] = {"fsdpp: error: ", "fsdpp: internal error: "};

}  // namespace

RankProcess::RankProcess(int rank, std::FILE* out, std::FILE* err) : rank_(rank), sinks_{out, err} {}

RankProcess::~RankProcess() {
  for (int& fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
}

void RankProcess::spawn(const std::vector<std::string>& argv,
                        const std::vector<std::pair<std::string, std::string>>& env) {
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0) throw UserError("launch: cannot create a pipe");
  if (::pipe2(err, O_CLOEXEC) != 0) {
    ::close(out[0]);
    ::close(out[1]);
    throw UserError("launch: cannot create a pipe");
  }
  const pid_t launcher = ::getpid();
  pid_ = ::fork();
  if (pid_ == 0) {
    ::setpgid(0, 0);
    // A rank outlives no launcher: when it dies (even by SIGKILL) the rank is told to stop
    // as by a user's SIGTERM, saving where [checkpoint] save_on_signal asks. A launcher gone
    // before the request took hold has left the rank nothing to do.
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != launcher) ::_exit(128 + SIGTERM);
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    for (const auto& [name, value] : env) ::setenv(name.c_str(), value.c_str(), 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::fprintf(stderr, "fsdpp: error: cannot run %s: %s\n", args[0], std::strerror(errno));
    ::_exit(127);
  }
  ::close(out[1]);
  ::close(err[1]);
  if (pid_ < 0) {
    ::close(out[0]);
    ::close(err[0]);
    throw UserError("launch: cannot start rank " + std::to_string(rank_) + ": " + std::strerror(errno));
  }
  fds_[0] = out[0];
  fds_[1] = err[0];
  running_ = true;
}

std::vector<int> RankProcess::open_descriptors() const {
  std::vector<int> out;
  for (int fd : fds_) {
    if (fd >= 0) out.push_back(fd);
  }
  return out;
}

void RankProcess::pump(bool until_eof) {
  for (int s = 0; s < 2; ++s) {
    while (fds_[s] >= 0) {
      pollfd ready{fds_[s], POLLIN, 0};
      if (!until_eof && ::poll(&ready, 1, 0) <= 0) break;
      char buffer[4096];
      const ssize_t n = ::read(fds_[s], buffer, sizeof buffer);
      if (n < 0 && errno == EINTR) continue;
      if (n > 0) {
        emit(s, buffer, static_cast<size_t>(n), false);
        continue;
      }
      emit(s, "", 0, true);  // end of file: the rank closed this stream
      ::close(fds_[s]);
      fds_[s] = -1;
    }
  }
}

void RankProcess::emit(int stream, const char* data, size_t size, bool flush_tail) {
  std::string& buffer = partial_[stream];
  buffer.append(data, size);
  size_t start = 0, newline;
  auto line_out = [&](std::string_view line) {
    for (const std::string_view prefix : kErrorPrefixes) {
      if (stream == 1 && line.starts_with(prefix)) {
        error_ = line.substr(prefix.size());
        return;
      }
    }
    std::fprintf(sinks_[stream], "[rank %d] %.*s\n", rank_, static_cast<int>(line.size()), line.data());
  };
  while ((newline = buffer.find('\n', start)) != std::string::npos) {
    line_out(std::string_view(buffer).substr(start, newline - start));
    start = newline + 1;
  }
  buffer.erase(0, start);
  if (flush_tail && !buffer.empty()) {
    line_out(buffer);
    buffer.clear();
  }
}

bool RankProcess::reap() {
  if (!running_) return true;
  if (::waitpid(pid_, &status_, WNOHANG) != pid_) return false;
  running_ = false;
  return true;
}

void RankProcess::signal(int sig, int stop) const {
  if (!running_) return;
  sigval value{};
  value.sival_int = stop;
  ::sigqueue(pid_, sig, value);
}

bool RankProcess::succeeded(int forwarded) const {
  if (WIFEXITED(status_)) return WEXITSTATUS(status_) == 0 || stop_signal() != 0;
  return forwarded != 0 && WIFSIGNALED(status_) && WTERMSIG(status_) == forwarded;
}

int RankProcess::stop_signal() const {
  if (!WIFEXITED(status_)) return 0;
  const int code = WEXITSTATUS(status_);
  return code == 128 + SIGTERM || code == 128 + SIGINT ? code - 128 : 0;
}

bool RankProcess::stopped_on_user_error() const {
  return WIFEXITED(status_) && WEXITSTATUS(status_) == 2 && !error_.empty();
}

bool RankProcess::ended_by_signal() const { return WIFSIGNALED(status_); }

std::string RankProcess::describe() const {
  if (WIFEXITED(status_)) return "exit status " + std::to_string(WEXITSTATUS(status_));
  if (WIFSIGNALED(status_)) return std::string("signal ") + ::strsignal(WTERMSIG(status_));
  return "status " + std::to_string(status_);
}

}  // namespace fsdpp
