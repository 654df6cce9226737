// Named failure points for crash tests: when FSDPP_FAILPOINT names the point (and
// FSDPP_FAILPOINT_RANK, if set, names this rank), the process raises `signal` right there:
// SIGKILL by default, as a power cut or the OOM killer would, leaving whatever it had
// written; SIGTERM or SIGINT where a test needs a stop request to arrive at a known place.
#pragma once

#include <csignal>
#include <string_view>

namespace fsdpp {

void failpoint(std::string_view name, int signal = SIGKILL);
// Where armed as failpoint() is, throws a UserError naming the point: a failure the process
// reports and stops on, as it would a full disk.
void failpoint_error(std::string_view name);

}  // namespace fsdpp
