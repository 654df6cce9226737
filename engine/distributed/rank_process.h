// One rank `fsdpp launch` starts: a child process whose stdout and stderr come back through
// pipes. The object owns the pid and both descriptors: it spawns the rank, pumps what it
// printed (line by line, prefixed with its rank), reaps its exit and says how it ended, so
// each failure path is a method one can read and test alone.
#pragma once

#include <sys/types.h>

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace fsdpp {

class RankProcess {
 public:
  // Lines go to `out` and `err` (stdout and stderr when launched).
  RankProcess(int rank, std::FILE* out = stdout, std::FILE* err = stderr);
  ~RankProcess();  // closes what is still open; the process is the caller's to stop
  RankProcess(const RankProcess&) = delete;
  RankProcess& operator=(const RankProcess&) = delete;

  // Runs argv[0] with `argv` and `env` added to this process's environment, in a process
  // group of its own (the launcher, not the terminal, decides which signals reach it).
  void spawn(const std::vector<std::string>& argv, const std::vector<std::pair<std::string, std::string>>& env);
  // Output descriptors still open, for poll().
  std::vector<int> open_descriptors() const;
  // Prints the complete lines waiting in the pipes (all of them to end-of-file when
  // `until_eof`, the rank having ended). The rank's own "fsdpp: error:" or "fsdpp: internal
  // error:" line is kept for the launcher's one report instead of printed.
  void pump(bool until_eof);
  // Collects the exit status if the rank has ended; true once it has.
  bool reap();
  // Sends `sig`, numbered: the launcher's `stop`th stop of the job (sigqueue's value; 0 for a
  // SIGKILL, which no rank sees). A rank told of a stop both by the launcher and directly (a
  // job's scheduler signals every process of the job) counts it once (run/train_loop.cpp).
  void signal(int sig, int stop = 0) const;

  int rank() const { return rank_; }
  pid_t pid() const { return pid_; }
  bool running() const { return running_; }
  // Ended cleanly: exit status 0; or stopped as a signal asks, whoever sent it: exit status
  // 128 + SIGTERM or SIGINT once it saved, or ended by `forwarded`, the signal the launcher
  // passed on (a second one, or one that came before the rank's handler was in place).
  bool succeeded(int forwarded) const;
  // The signal a clean stop answered (its exit status less 128), or 0.
  int stop_signal() const;
  // Ended on a user error (exit status 2) whose message it printed.
  bool stopped_on_user_error() const;
  // Ended by a signal: killed, or crashed.
  bool ended_by_signal() const;
  const std::string& error_message() const { return error_; }
  // "exit status 3", "signal Killed".
  std::string describe() const;

 private:
  void emit(int stream, const char* data, size_t size, bool flush_tail);

  int rank_;
  std::FILE* sinks_[2];
  pid_t pid_ = -1;
  int fds_[2] = {-1, -1};  // read ends: stdout, stderr
  std::string partial_[2];
  bool running_ = false;
  int status_ = 0;
  std::string error_;  // the rank's own "fsdpp: error: ..." message, if it printed one
};

}  // namespace fsdpp
