// Sharding one parameter and resizing its unsharded storage in place.
#include "fsdp/sharded_param.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include "core/dtype.h"
#include "core/module.h"

namespace fsdpp {

namespace {

// Swaps the storage's memory for a fresh block of `nbytes` from its own allocator (the
// device's caching allocator on a GPU), or for none. The old contents are dropped: callers
// refill the block before reading it.
void set_storage_bytes(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (nbytes == 0) {
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  } else {
    storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  }
  storage->set_nbytes(nbytes);
}

}  // namespace

ShardShape::ShardShape(at::IntArrayRef sizes, int world) {
  if (!sizes.empty()) {
    rows = sizes[0];
    row_numel = rows == 0 ? 0 : c10::multiply_integers(sizes) / rows;
  }
  padded_rows = (rows + world - 1) / world;
}

ShardedParam::ShardedParam(std::string name_, at::Tensor param_, int rank, int world_, const ShardFill& fill,
                           at::Tensor slot)
    : name(std::move(name_)), param(std::move(param_)), world(world_) {
  const ShardShape shape(param.sizes(), world);
  rows = shape.rows;
  row_numel = shape.row_numel;
  padded_rows = shape.padded_rows;
  first_row = std::min<int64_t>(rows, padded_rows * rank);
  owned_rows = std::min<int64_t>(rows, first_row + padded_rows) - first_row;
  at::NoGradGuard no_grad;
  // The master shard is fp32 whatever the parameter's dtype (fp64 for an fp64 one); a
  // frozen parameter's slot may hold it in another dtype, without a master.
  const auto dtype = master_dtype(param.scalar_type());
  if (slot.defined()) {
    TORCH_CHECK((slot.scalar_type() == dtype || !param.requires_grad()) && slot.numel() == shard_numel(), "parameter ",
                name, ": a slot of ", slot.numel(), " ", slot.scalar_type(), " elements for a shard of ",
                shard_numel(), " ", dtype);
    local = slot;
  } else {
    local = at::zeros({shard_numel()}, dtype);
  }
  // A scalar is stored as one row.
  std::vector<int64_t> owned_shape(param.sizes().begin(), param.sizes().end());
  if (owned_shape.empty()) owned_shape.push_back(1);
  owned_shape[0] = owned_rows;
  owned = local.narrow(0, 0, owned_rows * row_numel).view(owned_shape).detach();
  if (is_allocated(param)) {
    owned.view({owned_rows, row_numel}).copy_(param.detach().reshape({rows, row_numel}).narrow(0, first_row, owned_rows));
  } else {
    TORCH_CHECK(fill, "parameter ", name, " is unallocated and nothing initialises it");
    fill(name, param, owned, first_row);
  }
  owned.requires_grad_(param.requires_grad());
}

void ShardedParam::alloc_full() {
  if (is_full()) return;
  set_storage_bytes(param, static_cast<size_t>(world * shard_numel()) * param.element_size());
}

at::Tensor ShardedParam::padded_full() const {
  // variable_data() shares storage under a fresh version counter: a write through the view
  // is not taken by autograd for a change of the tensors it saved from the parameter.
  return param.variable_data().as_strided({world, shard_numel()}, {shard_numel(), 1}, 0);
}

void ShardedParam::view_full(const at::Tensor& buffer, int64_t offset) {
  TORCH_CHECK(world == 1 && buffer.scalar_type() == param.scalar_type() && buffer.device() == param.device() &&
                  offset + numel() <= buffer.numel(),
              "parameter ", name, ": cannot view elements [", offset, ", ", offset + numel(), ") of a ",
              buffer.numel(), "-element ", buffer.scalar_type(), " buffer at world ", world);
  if (numel() == 0) return;  // nothing to view, and nothing free_full() would end
  c10::StorageImpl* storage = param.storage().unsafeGetStorageImpl();
  void* first = static_cast<char*>(buffer.data_ptr()) + offset * buffer.element_size();
  storage->set_data_ptr_noswap(at::DataPtr(first, param.device()));  // no deleter: buffer owns it
  storage->set_nbytes(static_cast<size_t>(numel()) * param.element_size());
}

void ShardedParam::free_full() {
  if (param.storage().nbytes() > 0) set_storage_bytes(param, 0);
}

bool ShardedParam::is_full() const { return is_allocated(param); }

}  // namespace fsdpp
