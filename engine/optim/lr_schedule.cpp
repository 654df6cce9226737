// Warmup plus cosine/linear/constant learning-rate schedule.
#include "optim/lr_schedule.h"

#include "core/config_file.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace fsdpp {

ScheduleConfig ScheduleConfig::from_section(ConfigSection& s) {
  ScheduleConfig c;
  c.kind = s.get_choice("kind", c.kind,
                        {{"cosine", Decay::cosine}, {"linear", Decay::linear}, {"constant", Decay::constant}});
  c.warmup_steps = s.get_int("warmup_steps", c.warmup_steps, 0, kMaxSteps);
  c.min_lr_ratio = s.get_double("min_lr_ratio", c.min_lr_ratio, 0, 1);
  s.finish();
  return c;
}

LrSchedule::LrSchedule(const ScheduleConfig& config, double peak_lr, int64_t total_steps)
    : config_(config), peak_(peak_lr), total_(total_steps) {}

double LrSchedule::at(int64_t step) const {
  if (step <= config_.warmup_steps) {
    return peak_ * static_cast<double>(step) / static_cast<double>(config_.warmup_steps);
  }
  if (config_.kind == Decay::constant) return peak_;
  const double min_lr = peak_ * config_.min_lr_ratio;
  const double span = static_cast<double>(std::max<int64_t>(1, total_ - config_.warmup_steps));
  // The first step after warmup is at the peak and the last one short of min_lr, as in
  // transformers' schedules: a last step at min_lr = 0 would train nothing.
  const double progress = std::min(1.0, static_cast<double>(step - config_.warmup_steps - 1) / span);
  const double shape =
      config_.kind == Decay::cosine ? 0.5 * (1 + std::cos(std::numbers::pi * progress)) : 1 - progress;
  return min_lr + (peak_ - min_lr) * shape;
}

}  // namespace fsdpp
