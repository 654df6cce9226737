// The ticket is the backward's: the callback holds it, the engine's graph task holds the
// callback, and the task is freed when the backward has finished or failed.
#include "fsdp/backward_watch.h"

#include "core/error.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <memory>

namespace fsdpp {

namespace {

class Ticket {
 public:
  explicit Ticket(std::function<void()> on_release) : on_release_(std::move(on_release)) {}
  ~Ticket() { on_release_(); }
  Ticket(const Ticket&) = delete;
  Ticket& operator=(const Ticket&) = delete;

 private:
  std::function<void()> on_release_;
};

}  // namespace

void BackwardWatch::begin(std::function<void()> finish) {
  {
    std::lock_guard lock(mutex_);
    running_ = true;
    task_ = torch::autograd::get_current_graph_task_id();
  }
  auto ticket = std::make_shared<Ticket>([this] { over(); });
  torch::autograd::Engine::get_default_engine().queue_callback(
      [finish = std::move(finish), ticket = std::move(ticket)] { finish(); });
}

void BackwardWatch::over() {
  {
    std::lock_guard lock(mutex_);
    running_ = false;
  }
  ended_.notify_all();
}

void BackwardWatch::wait_until_over() {
  std::unique_lock lock(mutex_);
  if (running_ && torch::autograd::get_current_graph_task_id() == task_) {
    throw UserError("the run was called from inside its own backward (a hook of the loss?): call it after backward returns");
  }
  ended_.wait(lock, [this] { return !running_; });
}

}  // namespace fsdpp
