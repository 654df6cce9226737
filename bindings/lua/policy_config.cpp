// Parsing the [policy] section.
#include "bindings/lua/policy_config.h"

namespace fsdpp {

PolicyConfig PolicyConfig::from_section(ConfigSection& s) {
  PolicyConfig c;
  c.name = s.get_string("name", c.name);
  if (!c.name.empty()) c.name_where = s.where("name");
  for (auto& [name, value] : s.get_scalar_table("options")) {
    c.options.push_back({.name = name, .value = std::move(value), .where = s.where("options." + name)});
  }
  s.finish();
  return c;
}

}  // namespace fsdpp
