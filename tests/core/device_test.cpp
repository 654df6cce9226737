// Moving a batch to the device: on the CPU nothing is copied; to a GPU (when the test runs on
// one) the call returns without waiting for the work queued before it, and the copy owns its
// values at once, so the host may refill its batch, pinned or not, while the copy is queued.
// A copy that casts across the host boundary waits for no queued work either, and rounds as
// the host does.
#include "core/device.h"
#include "tensor_checks.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <catch2/catch.hpp>

using namespace fsdpp;

TEST_CASE("a batch stays where it is on the CPU", "[core]") {
  const c10::Device cpu(c10::kCPU);
  CHECK_FALSE(to_device(at::Tensor(), cpu).defined());
  const at::Tensor host = at::arange(16, at::kLong);
  CHECK(to_device(host, cpu).is_same(host));
}

TEST_CASE("a batch copied to a GPU neither waits for queued work nor reads the host late", "[core][gpu]") {
  if (!gpu_half_runs()) return;
  const bool pinned = GENERATE(false, true);
  INFO((pinned ? "pinned" : "pageable") << " host batch");
  const c10::Device gpu(c10::kCUDA, 0);
  at::Tensor host = at::arange(1 << 20, at::kLong);  // [N] token ids
  if (pinned) host = host.pin_memory();
  const at::Tensor expected = host.clone();
  to_device(host, gpu);  // the host allocator's pinned block exists from here on
  at::Tensor busy = at::randn({4096, 4096}, at::TensorOptions(at::kFloat).device(gpu));
  for (int i = 0; i < 32; ++i) busy = at::mm(busy, busy).tanh_();  // about 4 TFLOP queued
  c10::Event queued(c10::kCUDA);
  queued.record(c10::impl::VirtualGuardImpl(c10::kCUDA).getStream(gpu));
  const at::Tensor moved = to_device(host, gpu);
  CHECK_FALSE(queued.query());  // a copy that waited would have let the queued work finish
  host.fill_(-1);               // the next batch, written while the copy is still queued
  CHECK(moved.device() == gpu);
  CHECK(at::equal(moved.cpu(), expected));
}

TEST_CASE("a copy that casts on the CPU is ATen's cast", "[core]") {
  const at::Tensor src = at::randn({1000}, at::kFloat) * 1e3;  // [N]
  const at::Tensor dst = at::empty({1000}, at::kBFloat16);
  copy_cast(dst, src);
  CHECK(at::equal(dst, src.to(at::kBFloat16)));
}

TEST_CASE("a copy that casts across the host boundary neither waits for queued work nor rounds differently",
          "[core][gpu]") {
  if (!gpu_half_runs()) return;
  const bool to_gpu = GENERATE(true, false);
  INFO((to_gpu ? "pinned float32 host to bf16 GPU" : "float32 GPU to pinned bf16 host"));
  const c10::Device gpu(c10::kCUDA, 0);
  const int64_t n = (int64_t{1} << 24) + 3;  // 64 MiB of float32 and a ragged rest: two slices
  const at::Tensor values = at::randn({n}, at::kFloat) * 1e3;  // [N]
  const at::Tensor src = to_gpu ? values.pin_memory() : values.to(gpu);
  const at::Tensor dst = to_gpu ? at::empty({n}, at::TensorOptions(at::kBFloat16).device(gpu))
                                : at::empty({n}, at::TensorOptions(at::kBFloat16).pinned_memory(true));
  at::Tensor busy = at::randn({4096, 4096}, at::TensorOptions(at::kFloat).device(gpu));
  for (int i = 0; i < 32; ++i) busy = at::mm(busy, busy).tanh_();  // about 4 TFLOP queued
  c10::Event queued(c10::kCUDA);
  queued.record(c10::impl::VirtualGuardImpl(c10::kCUDA).getStream(gpu));
  copy_cast(dst, src);
  CHECK_FALSE(queued.query());  // a copy that waited would have let the queued work finish
  synchronize_device(gpu);
  CHECK(at::equal(dst.cpu(), values.to(at::kBFloat16)));  // the device rounds as the host does
}
