// Named failure points for crash tests: when FSDPP_FAILPOINT names the point (and
// FSDPP_FAILPOINT_RANK, if set, names this rank), the process kills itself with SIGKILL
// right there, as a power cut or the OOM killer would, leaving whatever it had written.
#pragma once

#include <string_view>

namespace fsdpp {

void failpoint(std::string_view name);

}  // namespace fsdpp
