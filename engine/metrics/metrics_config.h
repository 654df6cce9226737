// The [metrics] section: where per-step figures go and what the log line shows.
#pragma once

#include <cstdint>
#include <string>

namespace fsdpp {

class ConfigSection;

// When the log draws a progress bar.
enum class Progress {
  on_terminal,  // "auto": when stderr is a terminal
  always,
  never,
};

struct MetricsConfig {
  std::string jsonl;               // JSONL output; "" means <train.out_dir>/metrics.jsonl (metrics-<settings
                                   // hash>.jsonl under [train] reuse_out_dir)
  std::string tensorboard;         // TensorBoard event files; "" means <train.out_dir>/tensorboard
                                   // (tensorboard-<settings hash> under [train] reuse_out_dir)
  double peak_tflops = 0.0;        // one rank's device's dense peak TFLOP/s at the compute dtype, for MFU; 0: no MFU
  Progress progress = Progress::on_terminal;  // "auto", "always" or "never"
  int64_t profile_step = 0;        // > 0: trace that step into <train.out_dir>/profile-step-N-rank-R.json
  int64_t count_step = 0;          // > 0: count that step's kernels and bytes into <train.out_dir>/ops-step-N-rank-R.json

  static MetricsConfig from_section(ConfigSection& section);
};

}  // namespace fsdpp
