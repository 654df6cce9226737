// Learning-rate schedule: linear warmup to the peak, then cosine, linear or constant decay
// toward min_lr_ratio × the peak. After warmup, step s takes the learning rate transformers'
// get_cosine_with_min_lr_schedule_with_warmup (and the linear and constant ones) gives its
// step s - 1, counted from 0: the first step after warmup at the peak, the last short of the
// minimum. Warmup starts at peak / warmup_steps, where transformers' first step has 0.
#pragma once

#include <cstdint>

namespace fsdpp {

class ConfigSection;

// The decay after warmup.
enum class Decay { cosine, linear, constant };

struct ScheduleConfig {
  Decay kind = Decay::cosine;   // "cosine", "linear" or "constant" after warmup
  int64_t warmup_steps = 0;     // steps of linear warmup, step 1 at peak/warmup_steps
  double min_lr_ratio = 0.0;    // final learning rate as a share of the peak

  static ScheduleConfig from_section(ConfigSection& section);
};

class LrSchedule {
 public:
  LrSchedule(const ScheduleConfig& config, double peak_lr, int64_t total_steps);
  // The learning rate of step `step`, counted from 1.
  double at(int64_t step) const;

 private:
  ScheduleConfig config_;
  double peak_;
  int64_t total_;
};

}  // namespace fsdpp
