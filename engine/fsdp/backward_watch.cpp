// The ticket is the backward's: the callback holds it, the engine's graph task holds the
// callback, and the task is freed when the backward has finished or failed. A ticket of an
// earlier backward that the engine frees late (on a device thread) ends nothing of a later one.
#include "fsdp/backward_watch.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

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

BackwardWatch::BackwardWatch() : state_(std::make_shared<State>()) {}

void BackwardWatch::begin(std::function<void()> finish) {
  uint64_t generation = 0;
  {
    std::lock_guard lock(state_->mutex);
    generation = ++state_->generation;
    state_->running = true;
    state_->task = torch::autograd::get_current_graph_task_id();
  }
  auto ticket = std::make_shared<Ticket>([state = state_, generation] {
    {
      std::lock_guard lock(state->mutex);
      if (state->generation == generation) state->running = false;
    }
    state->ended.notify_all();
  });
  torch::autograd::Engine::get_default_engine().queue_callback(
      [finish = std::move(finish), ticket = std::move(ticket)] { finish(); });
}

bool BackwardWatch::inside() const {
  std::lock_guard lock(state_->mutex);
  return state_->running && torch::autograd::get_current_graph_task_id() == state_->task;
}

bool BackwardWatch::running_after(std::chrono::milliseconds grace) const {
  std::unique_lock lock(state_->mutex);
  return !state_->ended.wait_for(lock, grace, [this] { return !state_->running; });
}

bool BackwardWatch::wait_until_over() {
  std::unique_lock lock(state_->mutex);
  if (state_->running && torch::autograd::get_current_graph_task_id() == state_->task) return false;
  state_->ended.wait(lock, [this] { return !state_->running; });
  return true;
}

}  // namespace fsdpp
