// Parsing the [loss_scale] section, and the scale's growth and back-off.
#include "optim/loss_scale.h"

#include "core/config_file.h"
#include "core/error.h"
#include "core/log.h"

#include <algorithm>

namespace fsdpp {

LossScaleConfig LossScaleConfig::from_section(ConfigSection& s) {
  LossScaleConfig c;
  c.mode = s.get_choice("mode", c.mode, {{"auto", Mode::automatic}, {"dynamic", Mode::dynamic}, {"off", Mode::off}});
  c.init_scale = s.get_double("init_scale", c.init_scale, 1.0, 1e30);
  c.growth_factor = s.get_double("growth_factor", c.growth_factor, 1.0, 1e6);
  c.backoff_factor = s.get_double("backoff_factor", c.backoff_factor, 1e-6, 1.0);
  c.min_scale = s.get_double("min_scale", c.min_scale, 1e-30, 1e30);
  c.growth_interval = s.get_int("growth_interval", c.growth_interval, 1, int64_t{1} << 40);
  s.finish();
  if (!(c.growth_factor > 1.0)) s.fail("growth_factor", concat("must be above 1, got ", c.growth_factor));
  if (!(c.backoff_factor < 1.0)) s.fail("backoff_factor", concat("must be below 1, got ", c.backoff_factor));
  if (c.min_scale > c.init_scale) {
    s.fail("min_scale", concat("must not be above init_scale ", c.init_scale, ", got ", c.min_scale));
  }
  return c;
}

void LossScaler::update(bool finite) {
  if (!finite) {
    if (state_.scale <= config_.min_scale) {
      throw EveryRankError(concat("loss scale: a step's gradients are not finite at [loss_scale] min_scale = ",
                                  config_.min_scale, ", the lowest the scale backs off to (from init_scale ",
                                  config_.init_scale, "): float16 cannot hold this run's gradients, or its loss is "
                                  "not finite; compute in bfloat16 or float32, or lower min_scale"));
    }
    state_.scale = std::max(state_.scale * config_.backoff_factor, config_.min_scale);
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
