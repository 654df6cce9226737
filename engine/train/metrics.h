// The [metrics] section and the sink for per-step metrics: a log line every log_every
// steps, a progress bar when stderr is a terminal, and every record as one JSONL line.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

namespace fsdpp {

class ConfigSection;

struct MetricsConfig {
  std::string jsonl;               // JSONL output; "" means <train.out_dir>/metrics.jsonl
  std::string progress = "auto";   // progress bar: "auto" (on a terminal), "always", "never"
  int64_t profile_step = 0;        // > 0: trace that step into <train.out_dir>/profile-step-N-rank-R.json

  static MetricsConfig from_section(ConfigSection& section);
};

struct StepMetrics {
  int64_t step = 0;
  double loss = 0.0;         // mean next-token loss of the step's tokens
  double lr = 0.0;
  double grad_norm = 0.0;    // before clipping
  double tokens_per_s = 0.0; // since the previous record
  double elapsed_s = 0.0;    // since training began
  int64_t tokens = 0;        // trained so far
  bool skipped = false;      // the update was skipped (non-finite gradient norm)
};

class MetricsSink {
 public:
  // A run resumed after step `resumed_after` (> 0) keeps the file's records up to that step.
  MetricsSink(const MetricsConfig& config, const std::string& jsonl_path, int64_t total_steps,
              int64_t resumed_after = 0);
  ~MetricsSink();

  void record_step(const StepMetrics& m, bool log_line);
  void record_eval(int64_t step, double loss, double perplexity);

 private:
  void draw_progress(const StepMetrics& m);
  void clear_progress();

  std::ofstream jsonl_;
  int64_t total_steps_;
  bool progress_;
  bool bar_drawn_ = false;
};

}  // namespace fsdpp
