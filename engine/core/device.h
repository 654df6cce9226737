// The device a process computes on, and the device-generic operations the engine needs
// beyond ATen's. CUDA is reached through c10's device-guard registry, so nothing here
// needs the CUDA headers and a CPU-only machine runs the same binary.
#pragma once

#include "core/device_choice.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <string>

namespace fsdpp {

// The device `choice` names for this rank. A GPU that is asked for (by `asked_by`, the
// setting a message names) but not visible is a UserError naming the local rank, the local
// world and the count of visible devices.
c10::Device resolve_device(DeviceChoice choice, int local_rank, int local_world_size, const std::string& asked_by);
// Makes `device` current for this thread, so streams, allocations and collectives use it.
void use_device(c10::Device device);
// A host tensor (or none) on `device`. To a GPU the copy goes through pinned memory and is
// queued behind the work already on the current stream, where a copy from pageable memory
// would first wait for that work to finish.
at::Tensor to_device(const at::Tensor& host, c10::Device device);
// Copies `src` into `dst` (same shape, any two devices and dtypes), queued on the current
// stream without blocking the host when the host side is pinned and dense. ATen casts a
// host-to-device copy on the host, into a pageable temporary whose copy first waits for all
// the device's queued work; here the values cross in the host's dtype, a slice of at most
// 64 MiB at a time (so the device holds one slice in that dtype, not a copy of the whole),
// and are cast on the device.
void copy_cast(const at::Tensor& dst, const at::Tensor& src);
// Blocks the host until the work queued on the device's current stream is done (nothing to
// wait for on the CPU).
void synchronize_device(c10::Device device);

// The most memory the device's caching allocator has held for tensors and reserved from the
// driver since the process began, in GB (1e9 bytes); none on the CPU.
struct DeviceMemory {
  double allocated_gb = 0, reserved_gb = 0;
};
std::optional<DeviceMemory> device_peak_memory(c10::Device device);
// Returns the device memory the caching allocator holds but no tensor uses to the driver, for
// another process to allocate (nothing to do on the CPU).
void release_cached_memory(c10::Device device);
// A copy of `t` on `device`, in pinned memory when `device` is the host of a GPU run
// (`pinned`), so copies back run beside the compute.
at::Tensor moved_to(const at::Tensor& t, c10::Device device, bool pinned);

// The process's peak resident memory in GB.
double host_peak_memory_gb();

}  // namespace fsdpp
