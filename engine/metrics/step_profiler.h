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

  // Without a GPU, Kineto's start-up logs its failed device query as an ERROR line: this
  // quiets it (KINETO_LOG_LEVEL, where the user set none). Called before the run starts its
  // threads, since setting a variable races their reads of the environment.
  static void quiet_without_gpu();
  // Begins recording on this thread (and GPU activity from any thread).
  void start();
  // Stops recording and writes the trace to `path`; the caller has waited for the device.
  void stop_and_save(const std::string& path);
  bool active() const { return active_; }

 private:
  bool active_ = false;
};

}  // namespace fsdpp
