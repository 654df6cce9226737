// Failure points read their trigger from the environment once per call; they sit on slow
// paths (checkpoint saves) or once per step, so the lookup costs nothing that matters.
#include "core/failpoint.h"

#include "core/error.h"

#include <csignal>
#include <cstdlib>
#include <string>

namespace fsdpp {

namespace {

bool armed(std::string_view name) {
  const char* point = std::getenv("FSDPP_FAILPOINT");
  if (point == nullptr || name != point) return false;
  const char* only_rank = std::getenv("FSDPP_FAILPOINT_RANK");
  const char* rank = std::getenv("RANK");
  return only_rank == nullptr || std::string(only_rank) == (rank ? rank : "0");
}

}  // namespace

void failpoint(std::string_view name, int signal) {
  if (armed(name)) std::raise(signal);
}

void failpoint_error(std::string_view name) {
  if (armed(name)) throw UserError("failpoint " + std::string(name) + " fails here");
}

}  // namespace fsdpp
