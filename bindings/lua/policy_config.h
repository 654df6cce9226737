// The [policy] section: which wrap policy a run evaluates and the options its script reads
// (ctx.options). Parsed with the rest of the run file; no Lua is needed to read it.
#pragma once

#include "core/config_file.h"

#include <string>
#include <utility>
#include <vector>

namespace fsdpp {

using PolicyValue = ConfigScalar;

struct PolicyConfig {
  std::string name;  // a shipped policy's name, or a path to a .lua file; "" picks the model's own
  std::vector<std::pair<std::string, PolicyValue>> options;  // [policy.options], visible as ctx.options

  static PolicyConfig from_section(ConfigSection& section);
};

}  // namespace fsdpp
