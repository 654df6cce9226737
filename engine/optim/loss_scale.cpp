// Parsing the [loss_scale] section, and the scale's growth and back-off.
#include "optim/loss_scale.h"

#include "core/config_file.h"
#include "core/log.h"

namespace fsdpp {

LossScaleConfig LossScaleConfig::from_section(ConfigSection& s) {
  LossScaleConfig c;
  c.mode = s.get_choice("mode", c.mode, {{"auto", Mode::automatic}, {"dynamic", Mode::dynamic}, {"off", Mode::off}});
  c.init_scale = s.get_double("init_scale", c.init_scale, 1.0, 1e30);
  c.growth_factor = s.get_double("growth_factor", c.growth_factor, 1.0, 1e6);
  c.backoff_factor = s.get_double("backoff_factor", c.backoff_factor, 1e-6, 1.0);
  c.growth_interval = s.get_int("growth_interval", c.growth_interval, 1, int64_t{1} << 40);
  s.finish();
  if (!(c.growth_factor > 1.0)) s.fail("growth_factor", concat("must be above 1, got ", c.growth_factor));
  if (!(c.backoff_factor < 1.0)) s.fail("backoff_factor", concat("must be below 1, got ", c.backoff_factor));
  return c;
}

void LossScaler::update(bool finite) {
  if (!finite) {
    state_.scale *= config_.backoff_factor;
    state_.growth_tracker = 0;
    return;
  }
  // At or past: a run may resume with a shorter interval than its checkpoint's count.
  if (++state_.growth_tracker >= config_.growth_interval) {
    state_.scale *= config_.growth_factor;
    state_.growth_tracker = 0;
  }
}

}  // namespace fsdpp
