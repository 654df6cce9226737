// Sharding one parameter and resizing its unsharded storage in place.
#include "fsdp/sharded_param.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include "core/dtype.h"
#include "core/module.h"

namespace fsdpp {

namespace {

// Drops the storage's memory: the parameter keeps its tensor, which autograd may have
// saved, and no longer holds or views any values.
void release_storage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
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

void ShardedParam::view_full(const at::Tensor& buffer, int64_t offset) {
  const int64_t length = world * shard_numel();
  TORCH_CHECK(buffer.scalar_type() == param.scalar_type() && buffer.device() == param.device() &&
                  offset + length <= buffer.numel(),
              "parameter ", name, ": cannot view elements [", offset, ", ", offset + length, ") of a ",
              buffer.numel(), "-element ", buffer.scalar_type(), " buffer");
  if (length == 0) return;  // nothing to view, and nothing free_full() would end
  c10::StorageImpl* storage = param.storage().unsafeGetStorageImpl();
  void* first = static_cast<char*>(buffer.data_ptr()) + offset * buffer.element_size();
  storage->set_data_ptr_noswap(at::DataPtr(first, param.device()));  // no deleter: buffer owns it
  storage->set_nbytes(static_cast<size_t>(length) * param.element_size());
}

void ShardedParam::free_full() {
  if (param.storage().nbytes() > 0) release_storage(param);
}

bool ShardedParam::is_full() const { return is_allocated(param); }

void ShardedParam::note_grad_norm(const at::Tensor& norm) {
  const at::Tensor& grad = owned.grad();
  grad_norm = {norm, grad.unsafeGetTensorImpl(), grad._version()};
}

at::Tensor ShardedParam::known_grad_norm() const {
  const at::Tensor& grad = owned.grad();
  const bool same =
      grad.defined() && grad.unsafeGetTensorImpl() == grad_norm.grad && grad._version() == grad_norm.version;
  return same ? grad_norm.norm : at::Tensor();
}

}  // namespace fsdpp
