// LibTorch's Kineto profiler, as torch.profiler drives it from Python.
#include "metrics/step_profiler.h"

#include "core/error.h"

#include <ATen/Context.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdlib>
#include <filesystem>
#include <set>

namespace fsdpp {

namespace {

using torch::profiler::impl::ActivityType;

std::set<ActivityType> activities() {
  std::set<ActivityType> kinds{ActivityType::CPU};
  if (at::globalContext().hasCUDA()) kinds.insert(ActivityType::CUDA);
  return kinds;
}

torch::profiler::impl::ProfilerConfig config() {
  return torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::KINETO);
}

}  // namespace

StepProfiler::StepProfiler() = default;

StepProfiler::~StepProfiler() {
  if (active_) torch::autograd::profiler::disableProfiler();
}

void StepProfiler::quiet_without_gpu() {
  if (!at::globalContext().hasCUDA()) ::setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
}

void StepProfiler::start() {
  torch::autograd::profiler::prepareProfiler(config(), activities());
  torch::autograd::profiler::enableProfiler(config(), activities());
  active_ = true;
}

void StepProfiler::stop_and_save(const std::string& path) {
  active_ = false;
  auto result = torch::autograd::profiler::disableProfiler();
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  result->save(path);
}

}  // namespace fsdpp
