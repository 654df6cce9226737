// Parsing the [metrics] section.
#include "metrics/metrics_config.h"

#include "core/config_file.h"

namespace fsdpp {

MetricsConfig MetricsConfig::from_section(ConfigSection& s) {
  MetricsConfig c;
  c.jsonl = s.get_string("jsonl", c.jsonl);
  c.tensorboard = s.get_string("tensorboard", c.tensorboard);
  c.peak_tflops = s.get_double("peak_tflops", c.peak_tflops, 0, 1e6);
  c.progress = s.get_choice(
      "progress", c.progress, {{"auto", Progress::on_terminal}, {"always", Progress::always}, {"never", Progress::never}});
  c.profile_step = s.get_int("profile_step", c.profile_step, 0, kMaxSteps);  // 0: off
  c.count_step = s.get_int("count_step", c.count_step, 0, kMaxSteps);        // 0: off
  s.finish();
  return c;
}

}  // namespace fsdpp
