// Ordering between the compute stream and the copy stream with events.
#include "core/copy_stream.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace fsdpp {

CopyStream::CopyStream(c10::Device device) : device_(device) {
  if (!device.is_cpu()) stream_ = c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device);
}

std::optional<c10::Event> CopyStream::run(const std::function<void()>& enqueue,
                                          std::initializer_list<at::Tensor> uses) {
  if (!stream_) {
    enqueue();
    return std::nullopt;
  }
  c10::impl::VirtualGuardImpl guard(device_.type());
  c10::Event compute_so_far(device_.type());
  compute_so_far.record(guard.getStream(device_));
  compute_so_far.block(*stream_);
  // The caching allocator hands a freed block out again in its own stream's order; told of
  // the copy stream, it waits for that stream's work too.
  for (const auto& t : uses) {
    if (t.defined() && !t.is_cpu()) guard.recordDataPtrOnStream(t.storage().data_ptr(), *stream_);
  }
  {
    c10::StreamGuard on_copy_stream(*stream_);
    enqueue();
  }
  c10::Event done(device_.type());
  done.record(*stream_);
  return done;
}

void CopyStream::wait(std::optional<c10::Event>& done) {
  if (!done) return;
  done->block(c10::impl::VirtualGuardImpl(done->device_type()).getStream(done->device()));
  done.reset();
}

void CopyStream::synchronize() const {
  if (stream_) c10::impl::VirtualGuardImpl(device_.type()).synchronizeStream(*stream_);
}

}  // namespace fsdpp
