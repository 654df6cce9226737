// A process group as the engine sees it: the handful of collectives FSDP needs, over
// LibTorch's c10d backends. c10d's headers stay inside comm.cpp; a size-1 group needs no
// backend at all and its collectives are no-ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdpp {

// A collective that did not complete: a peer left the group (it failed or stopped) or did
// not reach the collective within the group's timeout. One line naming this rank and the
// group. Not a UserError: on a rank of a launched job it is the consequence of another's.
class CollectiveFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A collective in flight. Its output may be read only after wait(), which on a CPU backend
// blocks until the transfer is done and on a GPU backend makes the current stream wait for
// it (the host does not block), and throws CollectiveFailure where the backend failed. The
// tensors it reads and writes stay alive until then.
class CommWork {
 public:
  CommWork() = default;
  void wait();
  bool pending() const { return static_cast<bool>(impl_); }

 private:
  friend class Comm;
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

class Comm {
 public:
  ~Comm();
  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  // Where the backend moves data: the CPU for gloo, this rank's GPU for NCCL.
  c10::Device device() const { return device_; }

  // The blocking forms take tensors on any device (staged through the group's device and
  // waited for before returning), so small bookkeeping tensors may stay on the host.
  // out [size * n] = every rank's in [n], rank-major.
  void all_gather(at::Tensor& out, const at::Tensor& in);
  // out [n] = this rank's slice of the sum over ranks of in [size * n].
  void reduce_scatter_sum(at::Tensor& out, const at::Tensor& in);
  void all_reduce_sum(at::Tensor& t);
  // Every rank's `text`, in rank order.
  std::vector<std::string> all_gather_texts(const std::string& text);
  // The same on tensors already on the group's device, returning at once: compute may run
  // while the backend moves the data. Every rank of the group must issue the group's
  // collectives in the same order.
  CommWork all_gather_async(at::Tensor& out, const at::Tensor& in);
  CommWork reduce_scatter_sum_async(at::Tensor& out, const at::Tensor& in);
  CommWork all_reduce_sum_async(at::Tensor& t);

  // A group of one process on `device`: every collective returns its input.
  static std::shared_ptr<Comm> single(c10::Device device = c10::kCPU);
  // The world group, rendezvousing through a TCP store at addr:port (rank 0 serves it):
  // NCCL on a GPU `device`, gloo on the CPU. Sub-groups take the same backend.
  static std::shared_ptr<Comm> world(int rank, int size, const std::string& addr, int port,
                                     std::chrono::milliseconds timeout, c10::Device device = c10::kCPU);
  // A sub-group of `global_ranks` (which must include this process's world rank), with its
  // own store prefix so rendezvous keys of different groups never collide.
  std::shared_ptr<Comm> subgroup(const std::vector<int>& global_ranks, const std::string& tag);

 private:
  struct Handles;  // the c10d store and backend
  Comm();
  void check(const at::Tensor& t, const char* op) const;
  // "rank R: OP on group G (N ranks)", what a failed collective's message begins with.
  std::string failure_context(const char* op) const;
  using AsyncCollective = CommWork (Comm::*)(at::Tensor&, const at::Tensor&);
  // `collective` on copies on the group's device, waited for.
  void run_blocking(at::Tensor& out, const at::Tensor& in, AsyncCollective collective);

  int rank_ = 0, size_ = 1, world_rank_ = 0;
  std::string name_ = "single";
  std::chrono::milliseconds timeout_{0};
  c10::Device device_ = c10::kCPU;
  std::unique_ptr<Handles> c10d_;
};

}  // namespace fsdpp
