// c10d-backed collectives. Gloo reduces with SUM only (no AVG), so callers divide
// themselves. Each collective is issued asynchronously; the blocking forms wait at once.
#include "distributed/comm.h"

#include "core/error.h"

#include <ATen/ATen.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>

namespace fsdpp {

namespace {

// While it lives, c10's error log is held back: a rendezvous that fails is reported in one
// line by its caller, where c10d would log the socket's time-out with the exception's frames.
struct QuietC10dLog {
  QuietC10dLog() : saved(FLAGS_caffe2_log_level) { FLAGS_caffe2_log_level = c10::GLOG_FATAL; }
  ~QuietC10dLog() { FLAGS_caffe2_log_level = saved; }
  QuietC10dLog(const QuietC10dLog&) = delete;
  QuietC10dLog& operator=(const QuietC10dLog&) = delete;
  const int saved;
};

// Ranks started apart (a command per node) for worlds of other sizes would meet in a
// rendezvous that never completes, each timing out on its own words. Each rank posts the size
// it was started for; every other rank reads rank 0's, and rank 0 every other's, so that a
// rank of another size is named, and so is one that never comes.
void agree_on_world_size(c10d::Store& store, int rank, int size, std::chrono::milliseconds timeout) {
  const auto key = [](int r) { return "size/" + std::to_string(r); };
  const std::string mine = std::to_string(size);
  store.set(key(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::vector<int> peers;
  for (int r = rank == 0 ? 1 : 0; r < (rank == 0 ? size : 1); ++r) peers.push_back(r);
  std::vector<std::string> keys;
  for (int r : peers) keys.push_back(key(r));
  bool all_came = true;
  try {
    store.wait(keys, timeout);
  } catch (const std::exception&) {
    all_came = false;
  }
  // A rank of another world says more than one that never came, which it may be the cause of.
  std::string missing;
  for (int r : peers) {
    if (!all_came && !store.check({key(r)})) {
      missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      continue;
    }
    const std::vector<uint8_t> theirs = store.get(key(r));
    if (std::string(theirs.begin(), theirs.end()) == mine) continue;
    throw UserError("rank " + std::to_string(rank) + " was started for a world of " + mine + " ranks, but rank " +
                    std::to_string(r) + " for one of " + std::string(theirs.begin(), theirs.end()) +
                    ": every rank must be given the same WORLD_SIZE (fsdpp launch: the same --nnodes and "
                    "--nproc-per-node on every node)");
  }
  if (!missing.empty()) {
    throw UserError("rank " + std::to_string(rank) + ": rank(s) " + missing + " of the world of " + mine +
                    " did not come within [parallel] timeout_s (" + std::to_string(timeout.count() / 1000) +
                    " s): not started, or started for another world (WORLD_SIZE, or fsdpp launch's --nnodes x "
                    "--nproc-per-node)");
  }
}

c10::intrusive_ptr<c10d::Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                             int size, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  // GLOO_SOCKET_IFNAME picks the interface on multi-homed hosts, as it does for PyTorch.
  const char* iface = std::getenv("GLOO_SOCKET_IFNAME");
  options->devices.push_back(iface && *iface ? c10d::ProcessGroupGloo::createDeviceForInterface(iface)
                                             : c10d::ProcessGroupGloo::createDefaultDevice());
  options->threads = 1;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

c10::intrusive_ptr<c10d::Backend> make_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                std::chrono::milliseconds timeout, c10::Device device) {
  if (device.is_cpu()) return make_gloo(store, rank, size, timeout);
#ifdef USE_C10D_NCCL
  // A high-priority stream lets a collective start as soon as its input is ready rather than
  // queue behind compute kernels already waiting for the GPU.
  auto options = c10d::ProcessGroupNCCL::Options::create(/*is_high_priority_stream=*/true);
  options->timeout = timeout;
  auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
  // Bound to its device and connected now, so a communicator that cannot be made (a GPU
  // shared by two ranks, a broken transport) fails at start-up, not inside the first forward.
  backend->setBoundDeviceId(device);
  backend->eagerConnectSingleDevice(device);
  return backend;
#else
  throw UserError("this build of fsdpp has no NCCL: rebuild it where nccl.h is found to run on " + device.str());
#endif
}

// Runs `op` on copies on `device` when `t` lives elsewhere, copying the result back.
void on_device(at::Tensor& t, c10::Device device, const std::function<void(at::Tensor&)>& op) {
  if (t.device() == device) {
    op(t);
    return;
  }
  at::Tensor staged = t.to(device);
  op(staged);
  t.copy_(staged);
}

}  // namespace

struct CommWork::Impl {
  c10::intrusive_ptr<c10d::Work> work;
  std::vector<at::Tensor> keep_alive;  // the backend reads and writes these until done
  std::string where;                   // Comm::failure_context's
};

void CommWork::wait() {
  if (!impl_) return;
  auto impl = std::move(impl_);
  std::string why;
  try {
    impl->work->wait();
    return;
  } catch (const c10::Error& e) {  // its what() runs on with a backtrace
    why = e.what_without_backtrace();
  } catch (const std::exception& e) {  // gloo's own
    why = e.what();
  }
  throw CollectiveFailure(impl->where + " failed: " + first_line(why) + " (" + kAnotherRankFailed +
                          " or stopped, or took longer than [parallel] timeout_s)");
}

struct Comm::Handles {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
};

Comm::Comm() : c10d_(std::make_unique<Handles>()) {}

Comm::~Comm() {
  // NCCL communicators are finalised explicitly: left to process exit they may be torn down
  // while the driver unloads, with warnings or a hang instead of a clean end.
  if (!c10d_->backend) return;
  try {
    c10d_->backend->shutdown();
  } catch (const std::exception&) {
    // A group whose peer already stopped cannot shut down cleanly; the process ends anyway.
  }
}

std::shared_ptr<Comm> Comm::single(c10::Device device) {
  std::shared_ptr<Comm> comm(new Comm());
  comm->device_ = device;
  return comm;
}

std::shared_ptr<Comm> Comm::world(int rank, int size, const std::string& addr, int port,
                                  std::chrono::milliseconds timeout, c10::Device device) {
  std::shared_ptr<Comm> comm(new Comm());
  comm->rank_ = comm->world_rank_ = rank;
  comm->size_ = size;
  comm->name_ = "world";
  comm->timeout_ = timeout;
  comm->device_ = device;
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(port);
  opts.isServer = rank == 0;
  opts.numWorkers = size;
  // agree_on_world_size waits for the ranks instead, naming one of another world or none.
  opts.waitWorkers = false;
  opts.timeout = timeout;
  // Every rank makes its worlds in the same order (a Python loop's Runs, one after another),
  // so the count names the same world on each: a rank that starts its next world while a
  // slower one's previous store still serves meets no key of that previous world in it.
  static std::atomic<int64_t> worlds_made{0};
  const std::string prefix = "world" + std::to_string(worlds_made++) + "/";
  try {
    const QuietC10dLog quiet;
    comm->c10d_->store = c10::make_intrusive<c10d::TCPStore>(addr, opts);
    const auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, comm->c10d_->store);
    agree_on_world_size(*store, rank, size, timeout);
    comm->c10d_->backend = make_backend(store, rank, size, timeout, device);
  } catch (const UserError&) {
    throw;
  } catch (const std::exception& e) {
    throw UserError("rank " + std::to_string(rank) + ": rendezvous at " + addr + ":" + std::to_string(port) +
                    " failed: " + first_line(e.what()));
  }
  return comm;
}

std::shared_ptr<Comm> Comm::subgroup(const std::vector<int>& global_ranks, const std::string& tag) {
  auto it = std::find(global_ranks.begin(), global_ranks.end(), world_rank_);
  TORCH_CHECK(it != global_ranks.end(), "rank ", world_rank_, " is not in subgroup ", tag);
  std::shared_ptr<Comm> comm(new Comm());
  comm->rank_ = static_cast<int>(it - global_ranks.begin());
  comm->size_ = static_cast<int>(global_ranks.size());
  comm->world_rank_ = world_rank_;
  comm->name_ = tag;
  comm->timeout_ = timeout_;
  comm->device_ = device_;
  comm->c10d_->store = c10d_->store;
  if (comm->size_ > 1) {
    comm->c10d_->backend = make_backend(c10::make_intrusive<c10d::PrefixStore>(tag + "/", c10d_->store), comm->rank_,
                                        comm->size_, timeout_, device_);
  }
  return comm;
}

std::string Comm::failure_context(const char* op) const {
  return "rank " + std::to_string(world_rank_) + ": " + op + " on group " + name_ + " (" + std::to_string(size_) +
         " ranks)";
}

void Comm::check(const at::Tensor& t, const char* op) const {
  TORCH_CHECK(t.is_contiguous(), op, " on group ", name_, " needs contiguous tensors");
  TORCH_CHECK(!c10d_->backend || t.device() == device_, op, " on group ", name_, " needs tensors on ", device_, ", not ",
              t.device());
}

void Comm::run_blocking(at::Tensor& out, const at::Tensor& in, AsyncCollective collective) {
  if (!c10d_->backend) {
    out.copy_(in.reshape(out.sizes()));  // one rank: gather and reduce both return the input
    return;
  }
  at::Tensor input = in.to(device_);
  on_device(out, device_, [&](at::Tensor& o) { (this->*collective)(o, input).wait(); });
}

void Comm::all_gather(at::Tensor& out, const at::Tensor& in) { run_blocking(out, in, &Comm::all_gather_async); }

void Comm::reduce_scatter_sum(at::Tensor& out, const at::Tensor& in) {
  run_blocking(out, in, &Comm::reduce_scatter_sum_async);
}

void Comm::all_reduce_sum(at::Tensor& t) {
  if (!c10d_->backend) return;
  on_device(t, device_, [&](at::Tensor& x) { all_reduce_sum_async(x).wait(); });
}

std::vector<std::string> Comm::all_gather_texts(const std::string& text) {
  at::Tensor lengths = at::empty({size()}, at::kLong);  // [world]
  all_gather(lengths, at::tensor({static_cast<int64_t>(text.size())}, at::kLong));
  const int64_t longest = lengths.max().item<int64_t>();
  at::Tensor mine = at::zeros({longest}, at::kByte);  // [longest]
  std::memcpy(mine.data_ptr(), text.data(), text.size());
  at::Tensor all = at::empty({size() * longest}, at::kByte);  // [world * longest]
  all_gather(all, mine);
  std::vector<std::string> texts;
  for (int r = 0; r < size(); ++r) {
    const char* start = static_cast<const char*>(all.data_ptr()) + r * longest;
    texts.emplace_back(start, static_cast<size_t>(lengths[r].item<int64_t>()));
  }
  return texts;
}

CommWork Comm::all_gather_async(at::Tensor& out, const at::Tensor& in) {
  check(out, "all_gather");
  TORCH_CHECK(out.numel() == in.numel() * size_, "all_gather on group ", name_, ": output ", out.numel(), " != ", size_, " x ", in.numel());
  CommWork pending;
  if (!c10d_->backend) {
    out.copy_(in.reshape(out.sizes()));
    return pending;
  }
  at::Tensor input = in.contiguous();
  check(input, "all_gather");
  pending.impl_ = std::make_shared<CommWork::Impl>(
      CommWork::Impl{c10d_->backend->_allgather_base(out, input), {out, input}, failure_context("all_gather")});
  return pending;
}

CommWork Comm::reduce_scatter_sum_async(at::Tensor& out, const at::Tensor& in) {
  check(out, "reduce_scatter_sum");
  TORCH_CHECK(in.numel() == out.numel() * size_, "reduce_scatter on group ", name_, ": input ", in.numel(), " != ", size_, " x ", out.numel());
  CommWork pending;
  if (!c10d_->backend) {
    out.copy_(in.reshape(out.sizes()));
    return pending;
  }
  at::Tensor input = in.contiguous();
  check(input, "reduce_scatter_sum");
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  pending.impl_ = std::make_shared<CommWork::Impl>(
      CommWork::Impl{c10d_->backend->_reduce_scatter_base(out, input, opts), {out, input},
                     failure_context("reduce_scatter")});
  return pending;
}

CommWork Comm::all_reduce_sum_async(at::Tensor& t) {
  check(t, "all_reduce_sum");
  CommWork pending;
  if (!c10d_->backend) return pending;
  std::vector<at::Tensor> tensors{t};
  pending.impl_ = std::make_shared<CommWork::Impl>(
      CommWork::Impl{c10d_->backend->allreduce(tensors), {t}, failure_context("all_reduce")});
  return pending;
}

}  // namespace fsdpp
