// The local process launcher.
#include "distributed/launcher.h"
#include "distributed/dist_env.h"
#include "distributed/rank_process.h"

#include "core/error.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace fsdpp {

namespace {

int signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const unsigned char s = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = ::write(signal_pipe[1], &s, 1);
}

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

// The variables a rank reads its place in the job from (as torchrun sets them).
std::vector<std::pair<std::string, std::string>> rank_environment(const LaunchOptions& o, int local, int port) {
  const int world = o.nnodes * o.nproc_per_node;
  return {{"RANK", std::to_string(o.node_rank * o.nproc_per_node + local)},
          {"WORLD_SIZE", std::to_string(world)},
          {"LOCAL_RANK", std::to_string(local)},
          {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
          {"GROUP_RANK", std::to_string(o.node_rank)},
          {"MASTER_ADDR", o.master_addr},
          {"MASTER_PORT", std::to_string(port)},
          {"FSDPP_LAUNCHER_PREFIXES_RANK", "1"}};
}

// How long the launcher waits, after a rank fails other than on a user error, for another
// rank to end on one before stopping them all.
constexpr std::chrono::seconds kPeerReportTime{2};

// Waits up to 100 ms for output from any rank or a signal to the launcher; returns the
// signal that arrived, or 0.
int wait_for_activity(const std::vector<std::unique_ptr<RankProcess>>& ranks) {
  std::vector<pollfd> fds{{signal_pipe[0], POLLIN, 0}};
  for (const auto& r : ranks) {
    for (int fd : r->open_descriptors()) fds.push_back({fd, POLLIN, 0});
  }
  ::poll(fds.data(), fds.size(), 100);
  unsigned char sig = 0;
  if ((fds[0].revents & POLLIN) && ::read(signal_pipe[0], &sig, 1) == 1) return sig;
  return 0;
}

// How a job's ranks ended, as supervise() saw it.
struct JobEnd {
  const RankProcess* failed = nullptr;               // the first rank to fail; none when all succeeded
  std::vector<const RankProcess*> failed_unstopped;  // failures before the launcher stopped any rank
  std::vector<const RankProcess*> running_when_stopped;  // the ranks a failure's stop found running
  int stop_signal = 0;  // the signal every rank stopped for (passed on, or sent to the ranks), 0 if none
};

bool says_another_rank_failed(const RankProcess* r) {
  return r->error_message().find(kAnotherRankFailed) != std::string::npos;
}

// The ranks the others waited for in vain: where the first failure is a collective given up
// (a peer gone or too slow), the ranks that had not ended on their own by the time the
// launcher stopped the job. A rank that stopped answering (stalled, or stopped by SIGSTOP)
// leaves no failure of its own to report.
std::vector<const RankProcess*> unanswering(const JobEnd& end) {
  return says_another_rank_failed(end.failed) ? end.running_when_stopped : std::vector<const RankProcess*>{};
}

// "rank 1", "ranks 1, 3".
std::string rank_list(const std::vector<const RankProcess*>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) text += (i == 0 ? "" : ", ") + std::to_string(ranks[i]->rank());
  return text;
}

// The launcher's one line on a failed job, and its exit status 2. The cause is the rank that
// stopped on a user error saying why, else one that a signal ended (killed, or crashed)
// before the launcher stopped the rest, else one whose user error says another rank failed,
// else the ranks the others waited for in vain, else the first to fail: the others' failures
// (a peer gone from a collective) are its consequences, whichever the launcher saw first.
int report_failure(const std::vector<std::unique_ptr<RankProcess>>& ranks, const JobEnd& end) {
  const auto& failed_unstopped = end.failed_unstopped;
  const auto consequence = says_another_rank_failed;
  const RankProcess* user_error = nullptr;  // the first that says why, else the first
  for (const auto& r : ranks) {
    if (r->stopped_on_user_error() && (user_error == nullptr || (consequence(user_error) && !consequence(r.get())))) {
      user_error = r.get();
    }
  }
  const auto signalled = std::find_if(failed_unstopped.begin(), failed_unstopped.end(),
                                     [](const RankProcess* r) { return r->ended_by_signal(); });
  if (user_error != nullptr && (!consequence(user_error) || signalled == failed_unstopped.end())) {
    // A message that names its rank already (a rendezvous's) is not prefixed twice.
    const std::string named = "rank " + std::to_string(user_error->rank()) + ": ";
    const std::string& said = user_error->error_message();
    std::fprintf(stderr, "fsdpp: error: %s%s\n", said.starts_with(named) ? "" : named.c_str(), said.c_str());
    return 2;
  }
  if (const auto silent = unanswering(end); signalled == failed_unstopped.end() && !silent.empty()) {
    std::fprintf(stderr, "fsdpp: error: %s stopped answering: rank %d gave up waiting (%s)\n", rank_list(silent).c_str(),
                 end.failed->rank(), end.failed->error_message().c_str());
    return 2;
  }
  const RankProcess* cause = signalled != failed_unstopped.end() ? *signalled : end.failed;
  const std::string said = cause->error_message().empty() ? "" : ": " + cause->error_message();
  std::fprintf(stderr, "fsdpp: error: rank %d failed with %s%s\n", cause->rank(), cause->describe().c_str(),
               said.c_str());
  return 2;
}

// The launcher's own signals: SIGINT and SIGTERM written to signal_pipe, to be passed on to
// the ranks; SIGPIPE made harmless.
void catch_signals() {
  if (::pipe2(signal_pipe, O_CLOEXEC) != 0) throw UserError("launch: cannot create a pipe");
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  // A reader of the launcher's output gone (`| head`) must not end the launcher and, through
  // it, the ranks: a write to it fails instead. A handler, unlike SIG_IGN, is not inherited
  // by the ranks' exec.
  struct sigaction broken_pipe{};
  broken_pipe.sa_handler = [](int) {};
  ::sigaction(SIGPIPE, &broken_pipe, nullptr);
}

// Relays the ranks' output and the launcher's signals until every rank has ended, stopping
// the rest (SIGTERM, then SIGKILL after `grace_s`) once one fails.
JobEnd supervise(const std::vector<std::unique_ptr<RankProcess>>& ranks, double grace_s) {
  using Clock = std::chrono::steady_clock;
  const auto grace = std::chrono::milliseconds(static_cast<int64_t>(grace_s * 1000));
  JobEnd end;
  int forwarded = 0;
  int stopped = 0;  // the signal ranks stopped for without the launcher passing it on
  int stops = 0;    // the stops sent to the ranks, each numbered: a rank counts each once
  auto stop_time = Clock::time_point::max(), kill_time = Clock::time_point::max();
  auto signal_all = [&](int sig) {
    const int stop = sig == SIGKILL ? 0 : ++stops;
    for (auto& r : ranks) r->signal(sig, stop);
  };
  for (size_t running = ranks.size(); running > 0;) {
    if (const int sig = wait_for_activity(ranks)) {
      // No deadline: ranks that catch it save a checkpoint first, and a second signal,
      // passed on the same way, ends them at once.
      std::fprintf(stderr, "fsdpp launch: got %s; passing it to every rank\n", ::strsignal(sig));
      // A second one ends the ranks at once: one that cannot take it (stopped, stuck in the
      // kernel) is killed after the grace.
      if (forwarded != 0 && kill_time == Clock::time_point::max()) kill_time = Clock::now() + grace;
      forwarded = sig;
      signal_all(sig);
    }
    for (auto& r : ranks) {
      r->pump(false);
      if (!r->running() || !r->reap()) continue;
      --running;
      r->pump(true);  // what it printed before it ended
      if (r->succeeded(forwarded)) {
        // Sent to the ranks, not here. They agree on the first that arrived and exit on it;
        // the first rank's is kept, lest a later one (a rank stopped otherwise) replace it.
        if (forwarded == 0 && stopped == 0) stopped = r->stop_signal();
        continue;
      }
      if (kill_time == Clock::time_point::max()) end.failed_unstopped.push_back(r.get());
      if (end.failed != nullptr) continue;
      end.failed = r.get();
      // The rest would wait in a collective for it forever: they are stopped, then killed
      // after a grace. A failure other than a user error may itself be the consequence of a
      // peer whose user error closed the connection this rank lost while that peer was still
      // unwinding: the peer gets a moment to end and report it before any rank is stopped.
      stop_time = Clock::now() + (r->stopped_on_user_error() ? Clock::duration::zero() : kPeerReportTime);
    }
    if (Clock::now() > stop_time && kill_time == Clock::time_point::max()) {
      for (const auto& r : ranks) {
        if (r->running()) end.running_when_stopped.push_back(r.get());
      }
      signal_all(SIGTERM);
      kill_time = Clock::now() + grace;
    }
    if (Clock::now() > kill_time) signal_all(SIGKILL);
  }
  end.stop_signal = forwarded != 0 ? forwarded : stopped;
  return end;
}

}  // namespace

int launch(const LaunchOptions& o, const std::string& self_exe) {
  if (std::getenv("FSDPP_LAUNCHER_PREFIXES_RANK") != nullptr) {
    throw UserError("launch: this process is a rank of fsdpp launch already; give the command without a second launch");
  }
  if (const std::string why = unresolved_reason(o.master_addr); !why.empty()) {
    throw UserError("launch: --master-addr " + o.master_addr + " does not resolve (" + why + ")");
  }
  const int port = o.master_port == 0 ? free_port() : o.master_port;
  catch_signals();

  std::vector<std::string> argv{self_exe};
  argv.insert(argv.end(), o.command.begin(), o.command.end());
  std::vector<std::unique_ptr<RankProcess>> ranks;
  for (int local = 0; local < o.nproc_per_node; ++local) {
    ranks.push_back(std::make_unique<RankProcess>(o.node_rank * o.nproc_per_node + local));
    ranks.back()->spawn(argv, rank_environment(o, local, port));
  }
  const JobEnd end = supervise(ranks, o.grace_s);
  if (end.failed != nullptr) return report_failure(ranks, end);
  if (end.stop_signal != 0) {
    std::fprintf(stderr, "fsdpp launch: every rank stopped after %s\n", ::strsignal(end.stop_signal));
    return 128 + end.stop_signal;
  }
  return 0;
}

}  // namespace fsdpp
