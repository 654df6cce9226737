// What every fuzz target asserts: a parser given any bytes either accepts them or refuses
// them with a UserError, which the CLI prints as one line and exit status 2. Any other
// exception escapes to libFuzzer, which reports it as a crash, as it does a signal, a
// sanitizer report, a hang past -timeout or memory past -rss_limit_mb.
#pragma once

#include "core/error.h"

#include <cstddef>
#include <cstdint>
#include <string>

namespace fsdpp {

inline std::string fuzz_text(const uint8_t* data, size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

template <class Parse>
int fuzz_case(Parse&& parse) {
  try {
    parse();
  } catch (const UserError&) {
    // A refusal the user can act on: the outcome the engine promises for bad input.
  }
  return 0;
}

}  // namespace fsdpp
