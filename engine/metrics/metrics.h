// The sink for per-step metrics: a log line every log_every steps, a progress bar when
// stderr is a terminal, every record as one JSONL line, and a scalar per figure per step in
// TensorBoard event files (the same figures as the JSONL).
#pragma once

#include "metrics/metrics_config.h"

#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdpp {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0.0;         // mean next-token loss of the step's tokens (+ weighted load-balancing loss)
  double lr = 0.0;
  double grad_norm = 0.0;    // before clipping
  double tokens_per_s = 0.0; // since the previous record
  double elapsed_s = 0.0;    // since this process began training (a resumed run's: since it resumed)
  int64_t tokens = 0;        // trained so far: every position of every row, padding included
  int64_t targets = 0;       // this step's tokens the loss was taken over (no padding, no masked prompt)
  double eta_s = 0.0;        // time left at this run's pace so far
  double host_peak_gb = 0.0; // peak resident memory of the process
  std::optional<double> mfu;                  // model FLOPs utilisation (with peak_tflops)
  std::optional<double> device_allocated_gb;  // a GPU's peak allocated and reserved memory
  std::optional<double> device_reserved_gb;
  std::optional<double> aux_loss;             // a MoE model's load-balancing loss, unweighted
  std::optional<double> expert_load;          // busiest expert's tokens / its layer's mean, worst layer
  std::optional<double> loss_scale;           // what the loss was multiplied by (float16 compute)
  bool skipped = false;      // the update was skipped (non-finite gradient norm)

  // Every figure by its JSONL key, in order; the optional ones only when measured.
  std::vector<std::pair<std::string, double>> figures() const;
};

class TensorBoardWriter;

class MetricsSink {
 public:
  // A run resumed after step `resumed_after` (> 0) keeps the file's records up to that step.
  MetricsSink(const MetricsConfig& config, int64_t total_steps, int64_t resumed_after = 0);
  ~MetricsSink();

  void record_step(const StepMetrics& m, bool log_line);
  void record_eval(int64_t step, double loss, double perplexity);

 private:
  // Writes one JSONL record and flushes it; UserError naming the file where that fails.
  void write_record(const std::string& line);
  std::string step_line(const StepMetrics& m) const;
  void draw_progress(const StepMetrics& m);
  void clear_progress();

  std::string jsonl_path_;
  std::ofstream jsonl_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  int64_t total_steps_;
  bool progress_;
  bool bar_drawn_ = false;
};

}  // namespace fsdpp
