// Failure points read their trigger from the environment once per call; they sit on slow
// paths (checkpoint saves) or once per step, so the lookup costs nothing that matters.
#include "core/failpoint.h"

#include <csignal>
#include <cstdlib>
#include <string>

namespace fsdpp {

void failpoint(std::string_view name, int signal) {
  const char* armed = std::getenv("FSDPP_FAILPOINT");
  if (armed == nullptr || name != armed) return;
  const char* only_rank = std::getenv("FSDPP_FAILPOINT_RANK");
  const char* rank = std::getenv("RANK");
  if (only_rank != nullptr && std::string(only_rank) != (rank ? rank : "0")) return;
  std::raise(signal);
}

}  // namespace fsdpp
