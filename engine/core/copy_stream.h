// A stream beside the compute stream for the host<->device copies of offloaded shards, so
// they run while the device computes (as FSDP2 keeps its copies off the compute stream):
// work put on it starts once the work already queued on the compute stream is done, and the
// compute stream waits for it only where it reads what the copy wrote. On the CPU there is
// no stream: the work runs in place. Reached through c10's device-guard registry, like
// core/device.h, so nothing here needs the CUDA headers.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <functional>
#include <initializer_list>
#include <optional>

namespace fsdpp {

class CopyStream {
 public:
  explicit CopyStream(c10::Device device);

  // Puts `enqueue`'s work on the copy stream (current while it runs), behind the work queued
  // so far on the current stream: memory compute freed may be refilled, what it wrote may be
  // read. The device memory of `uses`, allocated from the compute stream's pool, is not
  // handed out again before the copy stream is done with it. Returns the event the work
  // ends at, for wait(); none where the work ran in place.
  std::optional<c10::Event> run(const std::function<void()>& enqueue, std::initializer_list<at::Tensor> uses);
  // Makes the current stream wait for `done`, and clears it (nothing for none).
  static void wait(std::optional<c10::Event>& done);
  // Blocks the host until everything put on the copy stream has finished.
  void synchronize() const;

 private:
  c10::Device device_;
  std::optional<c10::Stream> stream_;  // none on the CPU
};

}  // namespace fsdpp
