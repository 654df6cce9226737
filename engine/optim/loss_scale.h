// Dynamic loss scaling, for units that compute in float16. float16 holds magnitudes from about
// 6e-8 to 65504: gradients of a mean loss fall below the bottom of that range, so the step's
// loss is multiplied by a scale before backward, and AdamW's fused update divides it out
// again together with the clip. A step whose gradients overflowed (a global norm that is not
// finite, the same on every rank) is skipped and the scale backs off; after growth_interval
// finite steps in a row it grows. It backs off no lower than min_scale: a step that overflows
// there stops the run, where ShardedGradScaler would back off towards 0 (and a scale of 0
// skips every step after, saving it in checkpoints no resume can use). Its state is two
// numbers, alike on every rank, which checkpoints keep (so they carry over to any world size).
#pragma once

#include <algorithm>
#include <cstdint>

namespace fsdpp {

class ConfigSection;

// The [loss_scale] section.
struct LossScaleConfig {
  enum class Mode { automatic, dynamic, off };
  Mode mode = Mode::automatic;     // "auto": dynamic where any unit computes in float16; "dynamic"; "off"
  double init_scale = 65536.0;     // the first step's scale (2^16)
  double growth_factor = 2.0;      // the scale's factor after growth_interval finite steps in a row
  double backoff_factor = 0.5;     // its factor after a step whose gradients were not finite
  double min_scale = 1.0;          // the lowest it backs off to; a step that overflows there stops the run
  int64_t growth_interval = 2000;  // finite steps in a row before the scale grows

  static LossScaleConfig from_section(ConfigSection& section);
};

// Where the scale stands: the scale itself and the finite steps since it last changed.
struct LossScaleState {
  double scale = 65536.0;
  int64_t growth_tracker = 0;
};

class LossScaler {
 public:
  explicit LossScaler(const LossScaleConfig& config) : config_(config), state_{.scale = config.init_scale} {}

  double scale() const { return state_.scale; }
  // After a step: backs off when its gradients were not finite, else counts toward growth.
  // Gradients not finite at min_scale: an EveryRankError (the norm is every rank's).
  void update(bool finite);
  const LossScaleState& state() const { return state_; }
  // A checkpoint's state; a scale below min_scale (saved under a lower floor) starts at the floor.
  void restore(const LossScaleState& state) { state_ = {std::max(state.scale, config_.min_scale), state.growth_tracker}; }

 private:
  LossScaleConfig config_;
  LossScaleState state_;
};

}  // namespace fsdpp
