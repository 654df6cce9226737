// One backward through the units, from its first unit's pre-backward to its end, as the
// autograd engine runs it (on the thread that called backward, or the engine's device
// thread). It ends in the final callback the engine runs after its last node; an exception
// inside it (a hook of the caller's that raises, a node that fails) makes the engine drop
// that callback, and the units would wait for it for good. The engine frees a backward's
// callbacks with the backward itself, so a ticket held by the callback tells when the
// backward is over, whichever way it ended.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

namespace fsdpp {

class BackwardWatch {
 public:
  BackwardWatch();

  // At the backward's first pre-backward: queues `finish` as its final callback.
  void begin(std::function<void()> finish);
  // Whether the calling thread runs the backward begun last, and it still runs (a forward
  // inside it is a recomputation).
  bool inside() const;
  // Whether the backward begun last still runs (its ticket lives) after waiting up to
  // `grace` for it to end: the engine may free an ended one's ticket late, on a device thread.
  bool running_after(std::chrono::milliseconds grace) const;
  // From outside the backward begun last: returns once it is over, having waited for one
  // that another thread runs. From inside it (a recomputation the caller wraps, a hook that
  // calls into the run): returns false at once, waiting for nothing.
  bool wait_until_over();

 private:
  // Shared with the tickets, which the engine may free after the run is gone.
  struct State {
    std::mutex mutex;
    std::condition_variable ended;
    uint64_t generation = 0;  // of the backward begun last
    bool running = false;     // its ticket lives
    int task = -1;            // the autograd engine's id of it
  };
  std::shared_ptr<State> state_;
};

}  // namespace fsdpp
