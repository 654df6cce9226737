// Counting what a stretch of work (one training step) asks of the hardware, on any device and
// without one: the kernels it launches and the bytes that the kernels other than matrix
// products and attention read and write. Those kernels are memory-bound, so their bytes are
// their time on a GPU to first order, and a fusion or a removed copy shows as fewer kernels
// and bytes on a CPU-only machine too.
//
// The count sees every ATen operator call (ATen's RecordFunction observers) on every thread.
// A kernel is an operator call that ran no other operator call itself, and is neither a view
// nor a bare allocation: linear counts as its mm, to(dtype) as its copy_. The engine's own
// fused kernels record themselves as operators (RECORD_FUNCTION) so they count the same way.
// An operator's bytes are the sizes of its distinct tensor arguments and results, each at
// what the operator touches of it: a table an index reads or writes rows of (an embedding's
// lookup, index_select, index_add_) counts those rows alone, nll_loss's input one element per
// target, and an input read for its shape alone (zeros_like's, nll_loss_backward's) nothing.
// A tensor an operator writes in place (add_'s self, AdamW's parameters and moments) counts
// twice, read and written; an out= argument once, written.
// Collectives (c10d) are left out: their bytes cross the network, and the copies around them
// are counted.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace fsdpp {

struct OpTally {
  int64_t calls = 0;
  int64_t bytes = 0;
};

struct OpCounts {
  int64_t kernels = 0;            // every counted kernel
  int64_t matmul_kernels = 0;     // of which matrix products (mm, addmm, bmm, _scaled_mm, ...)
  int64_t attention_kernels = 0;  // of which attention, forward or backward
  int64_t other_bytes = 0;        // read and written by the kernels that are neither
  std::map<std::string, OpTally> by_op;  // every counted kernel's operator: calls and bytes

  int64_t other_kernels() const { return kernels - matmul_kernels - attention_kernels; }
  // {"kernels": .., "matmul_kernels": .., "attention_kernels": .., "other_kernels": ..,
  //  "other_bytes": .., "ops": {name: {"calls": .., "bytes": ..}}}
  std::string json() const;
};

// Counts from construction until stop(). One counter at a time in a process; start it and
// stop it where no operator runs on another thread (between steps).
class OpCounter {
 public:
  OpCounter();
  ~OpCounter();
  OpCounter(const OpCounter&) = delete;
  OpCounter& operator=(const OpCounter&) = delete;

  OpCounts stop();

 private:
  uint64_t handle_ = 0;  // the observer's, 0 once stopped
};

}  // namespace fsdpp
