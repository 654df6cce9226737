// Parsing the [optimizer] section.
#include "optim/optimizer_config.h"

#include "core/config_file.h"

#include <string>
#include <utility>

namespace fsdpp {

OptimizerConfig OptimizerConfig::from_section(ConfigSection& s) {
  OptimizerConfig c;
  c.lr = s.get_double("lr", c.lr, 0, 1e6);
  c.weight_decay = s.get_double("weight_decay", c.weight_decay, 0, 1e6);
  // A beta of 1 never forgets and its bias correction divides by zero.
  c.beta1 = s.get_double("beta1", c.beta1, 0, 1, ConfigSection::Max::excluded);
  c.beta2 = s.get_double("beta2", c.beta2, 0, 1, ConfigSection::Max::excluded);
  c.eps = s.get_double("eps", c.eps, 0, 1);
  using HostUpdate = OptimizerConfig::HostUpdate;
  c.host_update = s.get_choice("host_update", c.host_update,
                               {{"auto", HostUpdate::automatic}, {"overlapped", HostUpdate::overlapped},
                                {"in_step", HostUpdate::in_step}});
  s.finish();
  if (!(c.lr > 0)) s.fail("lr", "must be positive, got " + std::to_string(c.lr));
  if (!(c.eps > 0)) s.fail("eps", "must be positive");
  return c;
}

}  // namespace fsdpp
