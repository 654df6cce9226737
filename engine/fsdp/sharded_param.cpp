// Sharding one parameter and resizing its unsharded storage in place.
#include "fsdp/sharded_param.h"

#include <ATen/ATen.h>
#include <ATen/native/Resize.h>

namespace fsdpp {

ShardedParam::ShardedParam(std::string name_, at::Tensor param_, int rank, int world)
    : name(std::move(name_)), param(std::move(param_)) {
  if (param.dim() > 0) {
    rows = param.size(0);
    row_numel = rows == 0 ? 0 : param.numel() / rows;
  }
  padded_rows = (rows + world - 1) / world;
  const int64_t first = std::min<int64_t>(rows, padded_rows * rank);
  owned_rows = std::min<int64_t>(rows, first + padded_rows) - first;
  at::NoGradGuard no_grad;
  // The master shard is fp32 whatever the parameter's dtype, and owns its memory.
  local = at::zeros({shard_numel()}, param.options().dtype(at::kFloat));
  auto full_rows = param.detach().reshape({rows, row_numel});
  local.narrow(0, 0, owned_rows * row_numel).copy_(full_rows.narrow(0, first, owned_rows).reshape({-1}));
  std::vector<int64_t> owned_shape = param.sizes().vec();
  if (owned_shape.empty()) owned_shape = {1};
  owned_shape[0] = owned_rows;
  owned = local.narrow(0, 0, owned_rows * row_numel).view(owned_shape).detach();
  owned.requires_grad_(param.requires_grad());
}

void ShardedParam::alloc_full() {
  if (is_full()) return;
  at::native::resize_bytes_cpu(param.storage().unsafeGetStorageImpl(), param.numel() * param.element_size());
}

void ShardedParam::free_full() {
  at::native::resize_bytes_cpu(param.storage().unsafeGetStorageImpl(), 0);
}

bool ShardedParam::is_full() const {
  return param.storage().nbytes() >= static_cast<size_t>(param.numel() * param.element_size());
}

}  // namespace fsdpp
