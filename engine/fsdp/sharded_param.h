// One parameter sharded on dim 0 across a group, as FSDP2 shards it: rows split into
// ceil(rows / world) per rank, the trailing ranks padded, so every rank's padded shard has
// the same size and the rank-major concatenation of all shards is the full tensor followed
// by padding. The module keeps its own parameter tensor as the unsharded view; its storage
// views the unit's gathered values only while the unit is unsharded (0 bytes otherwise), so
// tensors autograd saved in forward stay valid across a free and re-gather.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace fsdpp {

// Gives a parameter of a meta-built model its values: writes rows [first_row, first_row +
// rows.size(0)) of the full parameter `name` (shape and dtype those of `param`) into `rows`,
// this rank's rows (fp32 masters, or a constant parameter's compute dtype). A source standing
// in for a materialised model (a fresh initialisation, HF weights) rounds through param's
// dtype; a checkpoint gives the masters.
using ShardFill =
    std::function<void(const std::string& name, const at::Tensor& param, at::Tensor& rows, int64_t first_row)>;

// How a tensor of `sizes` splits on dim 0 over `world` ranks: one place for the arithmetic
// the plan predicts with and the shards are cut by.
struct ShardShape {
  int64_t rows = 1;         // size of dim 0 (1 for a scalar)
  int64_t row_numel = 1;    // elements per row
  int64_t padded_rows = 0;  // rows per rank, ceil(rows / world)

  ShardShape(at::IntArrayRef sizes, int world);
  int64_t shard_numel() const { return padded_rows * row_numel; }
};

struct ShardedParam {
  // An unallocated `param` (a meta build) gets its rows from `fill`; an allocated one gives
  // its own. The fp32 master shard lives in `slot` when given (shard_numel() zeroed fp32
  // elements, e.g. the unit's slice of one flat buffer; a frozen param's slot may be of its
  // compute dtype instead, holding it with no master), else in fresh host memory.
  ShardedParam(std::string name, at::Tensor param, int rank, int world, const ShardFill& fill = {},
               at::Tensor slot = {});

  std::string name;          // dotted path of the first module that reaches it
  at::Tensor param;          // the module's parameter [full shape]; storage freed when sharded
  int64_t rows = 1;          // size of dim 0 (1 for a scalar)
  int64_t row_numel = 1;     // elements per row
  int64_t padded_rows = 0;   // rows per rank, ceil(rows / world)
  int64_t owned_rows = 0;    // real rows on this rank (the trailing ranks may own fewer, or none)
  int64_t first_row = 0;     // index of the first owned row in the full parameter
  at::Tensor local;          // [padded_rows * row_numel] this rank's rows then zero padding
  at::Tensor owned;          // [owned_rows, ...] view of local's real rows: what the optimizer updates
  int world = 1;             // ranks the rows are split over
  bool gradient_arrived = false;  // a backward brought it a gradient on this rank since FsdpState::forget_gradients
  // The 2-norm of one gradient of `owned` ([] float), taken where the gradient was made: the
  // gradient it was taken of is `grad` (a TensorImpl), at `version`.
  struct GradNorm {
    at::Tensor norm;
    const void* grad = nullptr;
    int64_t version = -1;
  } grad_norm;

  int64_t shard_numel() const { return padded_rows * row_numel; }
  int64_t numel() const { return rows * row_numel; }
  // Records `norm` as that of owned's gradient as it is now.
  void note_grad_norm(const at::Tensor& norm);
  // grad_norm's norm while owned's gradient is still the tensor it was taken of, unchanged
  // since; undefined once it has been replaced, changed in place, or dropped.
  at::Tensor known_grad_norm() const;
  // param views world * shard_numel() elements of `buffer` (param's dtype and device) from
  // element `offset`, owning none of them: the rank-major shards with their padding, so the
  // first numel() are the full parameter. `buffer` must outlive the view, which free_full()
  // ends; the values are the caller's to fill.
  void view_full(const at::Tensor& buffer, int64_t offset);
  void free_full();
  bool is_full() const;
};

}  // namespace fsdpp
