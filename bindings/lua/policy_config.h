// The [policy] section: which wrap policy a run evaluates and the options it gives the
// script, each with where it was set. Parsed with the rest of the run file; the options are
// checked against what the policy declares (options{...}) when it is evaluated.
#pragma once

#include "core/config_file.h"

#include <string>
#include <vector>

namespace fsdpp {

using PolicyValue = ConfigScalar;

// One [policy.options] entry.
struct GivenOption {
  std::string name;
  PolicyValue value;
  std::string where;  // "file:line" or the "--set ..." that gave it; "" for options set in code
};

struct PolicyConfig {
  std::string name;                  // a shipped policy's name, or a path to a .lua file; "" picks the model's own
  std::string name_where;            // where name was set ("file:line" or the "--set ..."); "" when it was not
  std::vector<GivenOption> options;  // [policy.options], in file order

  static PolicyConfig from_section(ConfigSection& section);
};

}  // namespace fsdpp
