// Tracing one training step: the CPU operators and, on a GPU, every kernel and copy with its
// stream and times, written as a Chrome trace (chrome://tracing, Perfetto) that
// scripts/profile_summary.py reduces to where the step's time went.
#pragma once

#include <memory>
#include <string>

namespace fsdpp {

class StepProfiler {
 public:
  StepProfiler();
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Begins recording on this thread (and GPU activity from any thread).
  void start();
  // Stops recording and writes the trace to `path`; the caller has waited for the device.
  void stop_and_save(const std::string& path);
  bool active() const { return active_; }

 private:
  bool active_ = false;
};

}  // namespace fsdpp
