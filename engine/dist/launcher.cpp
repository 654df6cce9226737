// The local process launcher.
#include "dist/launcher.h"

#include "core/error.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>

#include <string_view>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

namespace fsdpp {

namespace {

int signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const unsigned char s = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = ::write(signal_pipe[1], &s, 1);
}

int parse_int(const std::string& flag, const std::string& value, int min, int max) {
  try {
    size_t used = 0;
    int v = std::stoi(value, &used);
    if (used == value.size() && v >= min && v <= max) return v;
  } catch (const std::exception&) {
  }
  throw UserError("launch: " + flag + " takes a whole number in [" + std::to_string(min) + ", " + std::to_string(max) +
                  "], got '" + value + "'");
}

// Ranks one node may start: a few per core, as oversubscribed CPU tests run, and no more.
int max_local_ranks() { return 4 * static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw UserError("launch: cannot find a free port; pass --master-port");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

struct Child {
  int rank = 0;
  pid_t pid = -1;
  int out[2] = {-1, -1};  // read ends: stdout, stderr
  std::string partial[2];
  bool running = true;
  int status = 0;
  std::string user_error;  // the rank's own "fsdpp: error: ..." message, if it printed one
};

constexpr std::string_view kErrorPrefix = "fsdpp: error: ";

// Writes complete lines from `data` with the rank prefix; keeps the unfinished tail.
void emit(Child& c, int stream, const char* data, size_t n, bool flush_tail) {
  std::string& buf = c.partial[stream];
  buf.append(data, n);
  FILE* to = stream == 0 ? stdout : stderr;
  size_t start = 0, nl;
  while ((nl = buf.find('\n', start)) != std::string::npos) {
    const std::string_view line(buf.data() + start, nl - start);
    if (stream == 1 && line.starts_with(kErrorPrefix)) c.user_error = line.substr(kErrorPrefix.size());
    std::fprintf(to, "[rank %d] %.*s\n", c.rank, static_cast<int>(line.size()), line.data());
    start = nl + 1;
  }
  buf.erase(0, start);
  if (flush_tail && !buf.empty()) {
    std::fprintf(to, "[rank %d] %s\n", c.rank, buf.c_str());
    buf.clear();
  }
  std::fflush(to);
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + ::strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

}  // namespace

LaunchOptions parse_launch_args(const std::vector<std::string>& args) {
  LaunchOptions o;
  size_t i = 0;
  auto value = [&](const std::string& flag) -> std::string {
    if (i + 1 >= args.size()) throw UserError("launch: " + flag + " needs a value");
    return args[++i];
  };
  bool port_given = false;
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      o.command.assign(args.begin() + static_cast<long>(i) + 1, args.end());
      break;
    }
    if (a == "--nproc-per-node") o.nproc_per_node = parse_int(a, value(a), 1, max_local_ranks());
    else if (a == "--nnodes") o.nnodes = parse_int(a, value(a), 1, 1 << 16);
    else if (a == "--node-rank") o.node_rank = parse_int(a, value(a), 0, (1 << 16) - 1);
    else if (a == "--master-addr") o.master_addr = value(a);
    else if (a == "--master-port") o.master_port = parse_int(a, value(a), 1, 65535), port_given = true;
    else throw UserError("launch: unknown option " + a + " (see fsdpp launch --help)");
  }
  if (o.command.empty()) throw UserError("launch: missing '-- COMMAND', e.g. -- train run.toml");
  if (o.node_rank >= o.nnodes) {
    throw UserError("launch: --node-rank " + std::to_string(o.node_rank) + " must be below --nnodes " +
                    std::to_string(o.nnodes));
  }
  if (!port_given) o.master_port = o.nnodes == 1 ? 0 : 29500;
  return o;
}

int launch(const LaunchOptions& o, const std::string& self_exe) {
  const int port = o.master_port == 0 ? free_port() : o.master_port;
  const int world = o.nnodes * o.nproc_per_node;
  if (::pipe2(signal_pipe, O_CLOEXEC) != 0) throw UserError("launch: cannot create a pipe");
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  std::vector<Child> children(static_cast<size_t>(o.nproc_per_node));
  for (int local = 0; local < o.nproc_per_node; ++local) {
    Child& c = children[static_cast<size_t>(local)];
    c.rank = o.node_rank * o.nproc_per_node + local;
    int out_pipe[2], err_pipe[2];
    if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0) throw UserError("launch: cannot create a pipe");
    c.pid = ::fork();
    if (c.pid == 0) {
      ::setpgid(0, 0);  // the launcher, not the terminal, decides which signals reach ranks
      ::dup2(out_pipe[1], STDOUT_FILENO);
      ::dup2(err_pipe[1], STDERR_FILENO);
      ::setenv("RANK", std::to_string(c.rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(local).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node).c_str(), 1);
      ::setenv("GROUP_RANK", std::to_string(o.node_rank).c_str(), 1);
      ::setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("FSDPP_LAUNCHER_PREFIXES_RANK", "1", 1);
      std::vector<char*> argv{const_cast<char*>(self_exe.c_str())};
      for (const auto& a : o.command) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(self_exe.c_str(), argv.data());
      std::fprintf(stderr, "fsdpp launch: cannot run %s: %s\n", self_exe.c_str(), std::strerror(errno));
      ::_exit(127);
    }
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    c.out[0] = out_pipe[0];
    c.out[1] = err_pipe[0];
  }

  int failed_rank = -1;
  int forwarded = 0;
  std::string failure;
  bool stopping = false;
  auto stop_time = std::chrono::steady_clock::time_point::max();
  auto stop_all = [&](int sig) {
    for (auto& c : children) {
      if (c.running) ::kill(c.pid, sig);
    }
    if (!stopping) {
      stopping = true;
      stop_time = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.grace_s * 1000));
    }
  };

  size_t running = children.size();
  while (running > 0) {
    std::vector<pollfd> fds{{signal_pipe[0], POLLIN, 0}};
    for (auto& c : children) {
      for (int s = 0; s < 2; ++s) {
        if (c.out[s] >= 0) fds.push_back({c.out[s], POLLIN, 0});
      }
    }
    ::poll(fds.data(), fds.size(), 100);
    if (fds[0].revents & POLLIN) {
      unsigned char sig = 0;
      if (::read(signal_pipe[0], &sig, 1) == 1) {
        // No deadline: ranks that catch it save a checkpoint first, and a second signal,
        // passed on the same way, ends them at once.
        std::fprintf(stderr, "fsdpp launch: got %s; passing it to every rank\n", ::strsignal(sig));
        forwarded = sig;
        for (auto& c : children) {
          if (c.running) ::kill(c.pid, sig);
        }
      }
    }
    for (auto& c : children) {
      for (int s = 0; s < 2; ++s) {
        if (c.out[s] < 0) continue;
        char buf[4096];
        pollfd probe{c.out[s], POLLIN, 0};
        if (::poll(&probe, 1, 0) <= 0) continue;
        ssize_t n = ::read(c.out[s], buf, sizeof buf);
        if (n > 0) {
          emit(c, s, buf, static_cast<size_t>(n), false);
        } else {
          emit(c, s, "", 0, true);
          ::close(c.out[s]);
          c.out[s] = -1;
        }
      }
      if (!c.running) continue;
      if (::waitpid(c.pid, &c.status, WNOHANG) == c.pid) {
        c.running = false;
        --running;
        // A rank that stopped on the signal passed to it exits with 128 + that signal.
        const bool ok = WIFEXITED(c.status) &&
                        (WEXITSTATUS(c.status) == 0 || (forwarded != 0 && WEXITSTATUS(c.status) == 128 + forwarded));
        if (!ok && failed_rank < 0 && !stopping) {
          failed_rank = c.rank;
          failure = describe(c.status);
          std::fprintf(stderr, "fsdpp launch: rank %d (pid %d) ended with %s; stopping the other ranks\n",
                       c.rank, c.pid, failure.c_str());
          stop_all(SIGTERM);
        } else if (!ok && failed_rank < 0) {
          failed_rank = c.rank;
          failure = describe(c.status);
        }
      }
    }
    if (stopping && std::chrono::steady_clock::now() > stop_time) stop_all(SIGKILL);
  }
  for (auto& c : children) {
    for (int s = 0; s < 2; ++s) {
      if (c.out[s] < 0) continue;
      char buf[4096];
      ssize_t n;
      while ((n = ::read(c.out[s], buf, sizeof buf)) > 0) emit(c, s, buf, static_cast<size_t>(n), false);
      emit(c, s, "", 0, true);
      ::close(c.out[s]);
    }
  }
  if (failed_rank >= 0) {
    // A rank that stopped on a user error (exit status 2) is the cause; the others' failures
    // (a peer gone from a collective) are consequences, whichever the launcher saw first.
    for (const auto& c : children) {
      if (WIFEXITED(c.status) && WEXITSTATUS(c.status) == 2 && !c.user_error.empty()) {
        std::fprintf(stderr, "fsdpp: error: rank %d: %s\n", c.rank, c.user_error.c_str());
        return 2;
      }
    }
    std::fprintf(stderr, "fsdpp: error: rank %d failed with %s\n", failed_rank, failure.c_str());
    return 1;
  }
  if (forwarded != 0) {
    std::fprintf(stderr, "fsdpp launch: every rank stopped after %s\n", ::strsignal(forwarded));
    return 128 + forwarded;
  }
  return 0;
}

}  // namespace fsdpp
