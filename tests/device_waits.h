// A scope in which any wait of the host for the GPU raises: c10's synchronisation debug mode,
// which makes an error of every operator that would read device memory back (an item, a copy
// to the host, a size known only once the device has computed it). Where LibTorch's CUDA
// headers are not found, FSDPP_TESTS_SEE_DEVICE_WAITS stays undefined and the tests that use
// this are left out.
#pragma once

#if __has_include(<c10/cuda/CUDAFunctions.h>) && __has_include(<cuda_runtime_api.h>)
#include <c10/cuda/CUDAFunctions.h>

#define FSDPP_TESTS_SEE_DEVICE_WAITS 1

namespace fsdpp {

class DeviceWaitsRaise {
 public:
  DeviceWaitsRaise() : before_(c10::cuda::warning_state().get_sync_debug_mode()) {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  }
  ~DeviceWaitsRaise() { c10::cuda::warning_state().set_sync_debug_mode(before_); }
  DeviceWaitsRaise(const DeviceWaitsRaise&) = delete;
  DeviceWaitsRaise& operator=(const DeviceWaitsRaise&) = delete;

 private:
  c10::cuda::SyncDebugMode before_;
};

}  // namespace fsdpp
#endif
