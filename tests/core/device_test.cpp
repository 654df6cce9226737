// Moving a batch to the device: on the CPU nothing is copied; to a GPU (when the test runs on
// one) the copy owns its values as soon as it returns, so the host may refill its batch while
// the copy is still queued behind earlier work.
#include "core/device.h"
#include "tensor_checks.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

using namespace fsdpp;

TEST_CASE("a batch moved to the device keeps its values while the host refills it", "[core][gpu]") {
  const bool gpu = gpu_half_runs();
  const c10::Device device = gpu ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  CHECK_FALSE(to_device(at::Tensor(), device).defined());
  at::Tensor host = at::arange(1 << 20, at::kLong);  // [N] token ids, pageable
  const at::Tensor expected = host.clone();
  at::Tensor busy;
  if (gpu) busy = at::randn({4096, 4096}, at::TensorOptions(at::kFloat).device(device));
  for (int i = 0; gpu && i < 8; ++i) busy = at::mm(busy, busy).tanh_();  // work queued ahead of the copy
  const at::Tensor moved = to_device(host, device);
  CHECK(moved.device() == device);
  if (!gpu) CHECK(moved.is_same(host));  // no copy on the CPU
  host.fill_(-1);                        // the next batch, written while the copy may be queued
  if (gpu) CHECK(at::equal(moved.cpu(), expected));
}
