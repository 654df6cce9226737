// One backward through the units, from its first unit's pre-backward to its end, as the
// autograd engine runs it (on the thread that called backward, or the engine's device
// thread). It ends in the final callback the engine runs after its last node; an exception
// inside it (a hook of the caller's that raises, a node that fails) makes the engine drop
// that callback, and the units would wait for it for good. The engine frees a backward's
// callbacks with the backward itself, so a ticket held by the callback tells when the
// backward is over, whichever way it ended.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>

namespace fsdpp {

class BackwardWatch {
 public:
  // At the backward's first pre-backward: queues `finish` as its final callback.
  void begin(std::function<void()> finish);
  // From outside that backward: returns once it is over (at once when none runs), having
  // waited for one that another thread runs. UserError when called from inside it (a hook
  // that calls into the run).
  void wait_until_over();

 private:
  void over();

  std::mutex mutex_;
  std::condition_variable ended_;
  bool running_ = false;
  int task_ = -1;  // the autograd engine's id of the backward that runs
};

}  // namespace fsdpp
