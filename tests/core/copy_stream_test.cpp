// The copy stream: on the CPU its work runs in place; on a GPU (when the test runs on one)
// a host-to-device copy put on it is what the compute stream reads once it waits.
#include "core/copy_stream.h"
#include "tensor_checks.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

using namespace fsdpp;

TEST_CASE("a copy on the copy stream is what the compute stream reads once it waits", "[core][gpu]") {
  const bool gpu = gpu_half_runs();
  const c10::Device device = gpu ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  CopyStream stream(device);
  at::Tensor host = at::arange(1 << 20, at::kFloat);  // [N]
  if (gpu) host = host.pin_memory();
  at::Tensor copied = at::empty(host.sizes(), host.options().device(device).pinned_memory(false));
  bool ran = false;
  auto done = stream.run(
      [&] {
        copied.copy_(host, /*non_blocking=*/true);
        ran = true;
      },
      {copied});
  CHECK(ran);                          // enqueued before run returns
  CHECK(done.has_value() == gpu);      // an event only where there is a stream
  CopyStream::wait(done);
  CHECK_FALSE(done.has_value());
  CHECK(at::equal((copied * 2).cpu(), host * 2));  // computed on the compute stream
  stream.synchronize();
}
