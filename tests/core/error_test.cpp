// UserError keeps every message on one line, whatever a bad file puts into it.
#include "core/error.h"

#include <catch2/catch.hpp>

using namespace fsdpp;

TEST_CASE("a UserError quoting control characters stays one printable line", "[error]") {
  const UserError error("config.json: key 'a\nb\tc\x1b[2J\x7f' is unknown");
  CHECK(std::string(error.what()) == "config.json: key 'a\\nb\\tc\\x1b[2J\\x7f' is unknown");
  // Wrapping an error's message in another changes nothing further.
  const UserError wrapped(std::string("run.toml: ") + error.what());
  CHECK(std::string(wrapped.what()) == std::string("run.toml: ") + error.what());
}
