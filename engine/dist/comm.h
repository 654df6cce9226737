// A process group as the engine sees it: the handful of collectives FSDP needs, over
// LibTorch's c10d backends. c10d's headers stay inside comm.cpp; a size-1 group needs no
// backend at all and its collectives are no-ops.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace fsdpp {

class Comm {
 public:
  ~Comm();
  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }

  // out [size * n] = every rank's in [n], rank-major.
  void all_gather(at::Tensor& out, const at::Tensor& in);
  // out [n] = this rank's slice of the sum over ranks of in [size * n].
  void reduce_scatter_sum(at::Tensor& out, const at::Tensor& in);
  void all_reduce_sum(at::Tensor& t);

  // A group of one process: every collective returns its input.
  static std::shared_ptr<Comm> single();
  // The world group, rendezvousing through a TCP store at addr:port (rank 0 serves it).
  static std::shared_ptr<Comm> world(int rank, int size, const std::string& addr, int port,
                                     std::chrono::milliseconds timeout);
  // A sub-group of `global_ranks` (which must include this process's world rank), with its
  // own store prefix so rendezvous keys of different groups never collide.
  std::shared_ptr<Comm> subgroup(const std::vector<int>& global_ranks, const std::string& tag);

 private:
  struct Handles;  // the c10d store and backend
  Comm();
  void check(const at::Tensor& t, const char* op) const;

  int rank_ = 0, size_ = 1, world_rank_ = 0;
  std::string name_ = "single";
  std::chrono::milliseconds timeout_{0};
  std::unique_ptr<Handles> c10d_;
};

}  // namespace fsdpp
