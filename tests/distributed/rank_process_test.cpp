// A rank process on its own: its lines come out prefixed, its own error line is kept for the
// launcher's single report, and each way it can end is told apart.
#include "distributed/rank_process.h"

#include <catch2/catch.hpp>

#include <csignal>
#include <cstdio>
#include <string>

using namespace fsdpp;

namespace {

std::string read_all(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string text;
  for (int c; (c = std::fgetc(f)) != EOF;) text.push_back(static_cast<char>(c));
  return text;
}

// Runs `script` in sh as rank 3, pumping until it ends.
void run(RankProcess& rank, const std::string& script) {
  rank.spawn({"/bin/sh", "-c", script}, {{"GREETING", "hello"}});
  while (!rank.reap()) rank.pump(false);
  rank.pump(true);
}

}  // namespace

TEST_CASE("a rank's output is prefixed and its own error line kept for the launcher", "[launch]") {
  std::FILE* out = std::tmpfile();
  std::FILE* err = std::tmpfile();
  RankProcess rank(3, out, err);
  run(rank, "echo $GREETING; echo 'a warning' >&2; echo 'fsdpp: error: bad value' >&2; printf 'no newline'; exit 2");
  CHECK(read_all(out) == "[rank 3] hello\n[rank 3] no newline\n");
  CHECK(read_all(err) == "[rank 3] a warning\n");
  CHECK(rank.stopped_on_user_error());
  CHECK(rank.error_message() == "bad value");
  CHECK_FALSE(rank.succeeded(0));
  CHECK(rank.describe() == "exit status 2");
  CHECK(rank.open_descriptors().empty());
  std::fclose(out);
  std::fclose(err);
}

TEST_CASE("a rank's end is told apart: success, a stop on a signal, a crash", "[launch]") {
  std::FILE* sink = std::tmpfile();
  RankProcess ok(0, sink, sink), stopped(1, sink, sink), killed(2, sink, sink), failed(3, sink, sink),
      ended(4, sink, sink);
  run(ok, "exit 0");
  CHECK(ok.succeeded(0));
  CHECK(ok.stop_signal() == 0);
  // 128 + SIGTERM: it saved and stopped, on a signal passed on or sent to it alone.
  run(stopped, "exit 143");
  CHECK(stopped.succeeded(SIGTERM));
  CHECK(stopped.succeeded(0));
  CHECK(stopped.stop_signal() == SIGTERM);
  // Ended by the signal passed on (a second one): a stop; by another, or unasked, a failure.
  run(ended, "kill -TERM $$");
  CHECK(ended.succeeded(SIGTERM));
  CHECK_FALSE(ended.succeeded(0));
  CHECK_FALSE(ended.succeeded(SIGINT));
  run(killed, "kill -9 $$");
  CHECK_FALSE(killed.succeeded(0));
  CHECK_FALSE(killed.succeeded(SIGTERM));
  CHECK(killed.ended_by_signal());
  CHECK(killed.describe() == "signal Killed");
  run(failed, "exit 1");
  CHECK_FALSE(failed.stopped_on_user_error());  // no message of its own: not a user error
  CHECK_FALSE(failed.ended_by_signal());
  std::fclose(sink);
}

TEST_CASE("a rank's internal error is kept for the launcher's report, not printed", "[launch]") {
  std::FILE* out = std::tmpfile();
  std::FILE* err = std::tmpfile();
  RankProcess rank(1, out, err);
  run(rank, "echo 'fsdpp: internal error: Connection closed by peer' >&2; exit 1");
  CHECK(read_all(err).empty());
  CHECK(rank.error_message() == "Connection closed by peer");
  CHECK_FALSE(rank.stopped_on_user_error());  // exit status 1: a failure, not the user's
  std::fclose(out);
  std::fclose(err);
}
