// Device choice, batch copies to the device, and host-device synchronisation through c10's
// virtual device guards.
#include "core/device.h"

#include "core/error.h"

#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <sys/resource.h>

#include <algorithm>

namespace fsdpp {

c10::Device resolve_device(DeviceChoice choice, int local_rank, int local_world_size, const std::string& asked_by) {
  if (choice == DeviceChoice::cpu) return c10::kCPU;
  const bool has_cuda = at::globalContext().hasCUDA();
  if (choice == DeviceChoice::automatic && !has_cuda) return c10::kCPU;
  const int visible = has_cuda ? c10::impl::VirtualGuardImpl(c10::kCUDA).deviceCount() : 0;
  if (visible == 0) {
    throw UserError((asked_by.empty() ? "[parallel] device = \"auto\" found CUDA" : asked_by) +
                    ", but this process sees no GPU; use device = \"cpu\" and backend = \"gloo\" (or both "
                    "\"auto\", which take a GPU where there is one)");
  }
  // A scheduler that binds one GPU to each task shows every rank a single device, whatever
  // its local rank. Several local ranks seeing that same one device would share it, which
  // NCCL refuses ("duplicate GPU") only once the first collective runs.
  if (visible == 1 && local_world_size == 1) return {c10::kCUDA, 0};
  if (local_rank >= visible) {
    throw UserError("local rank " + std::to_string(local_rank) + " of " + std::to_string(local_world_size) +
                    " needs a GPU of its own but this process sees " + std::to_string(visible) +
                    " CUDA device(s); run at most " + std::to_string(visible) + " rank(s) per node on GPUs");
  }
  return {c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank)};
}

void use_device(c10::Device device) {
  if (device.is_cpu()) return;
  c10::impl::VirtualGuardImpl(device.type()).setDevice(device);
}

at::Tensor to_device(const at::Tensor& host, c10::Device device) {
  if (!host.defined()) return host;
  if (device.is_cpu() || !host.is_cpu()) return host.to(device);
  // A fresh block of the host allocator's, even for a pinned input (which pin_memory() would
  // hand back as it is, for the caller to overwrite while the copy still reads it): the
  // allocator keeps the block until the copy reading it is done.
  const auto staged = at::empty(host.sizes(), host.options().pinned_memory(true)).copy_(host);
  return staged.to(device, /*non_blocking=*/true);
}

void copy_cast(const at::Tensor& dst, const at::Tensor& src) {
  // A copy from a device casts there already, and a copy that does not cross needs no help.
  if (!src.is_cpu() || dst.is_cpu() || dst.scalar_type() == src.scalar_type()) {
    dst.copy_(src, /*non_blocking=*/true);
    return;
  }
  if (!dst.is_contiguous() || !src.is_contiguous()) {
    dst.copy_(src.to(dst.device(), /*non_blocking=*/true));
    return;
  }
  // Each slice's block returns to the current stream's pool and serves the next slice in
  // that stream's order.
  constexpr int64_t kSliceBytes = int64_t{64} << 20;
  const int64_t slice = std::max<int64_t>(1, kSliceBytes / static_cast<int64_t>(src.element_size()));
  const at::Tensor to = dst.view({-1}), from = src.view({-1});
  for (int64_t offset = 0; offset < from.numel(); offset += slice) {
    const int64_t length = std::min(slice, from.numel() - offset);
    to.narrow(0, offset, length).copy_(from.narrow(0, offset, length).to(dst.device(), /*non_blocking=*/true));
  }
}

void synchronize_device(c10::Device device) {
  if (device.is_cpu()) return;
  c10::impl::VirtualGuardImpl guard(device.type());
  guard.synchronizeStream(guard.getStream(device));
}

std::optional<DeviceMemory> device_peak_memory(c10::Device device) {
  if (device.is_cpu()) return std::nullopt;
  const auto stats = at::accelerator::getDeviceStats(device.index());
  const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  return DeviceMemory{static_cast<double>(stats.allocated_bytes[all].peak) / 1e9,
                      static_cast<double>(stats.reserved_bytes[all].peak) / 1e9};
}

void release_cached_memory(c10::Device device) {
  if (device.is_cpu()) return;
  synchronize_device(device);  // a block still in use by queued work is not free yet
  at::accelerator::emptyCache();
}

at::Tensor moved_to(const at::Tensor& t, c10::Device device, bool pinned) {
  at::Tensor out = at::empty(t.sizes(), t.options().device(device).pinned_memory(pinned && device.is_cpu()));
  out.copy_(t);
  return out;
}

double host_peak_memory_gb() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) * 1024 / 1e9;  // Linux reports KiB
}

}  // namespace fsdpp
