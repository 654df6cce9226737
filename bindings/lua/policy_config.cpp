// Parsing the [policy] section.
#include "bindings/lua/policy_config.h"

namespace fsdpp {

PolicyConfig PolicyConfig::from_section(ConfigSection& s) {
  PolicyConfig c;
  c.name = s.get_string("name", c.name);
  c.options = s.get_scalar_table("options");
  s.finish();
  return c;
}

}  // namespace fsdpp
