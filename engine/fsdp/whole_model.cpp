// One process's view of its whole model.
#include "fsdp/whole_model.h"

namespace fsdpp {

std::vector<ShardRows> WholeModel::shard_rows() const {
  std::vector<ShardRows> out;
  for (const auto& p : params_) out.push_back({p.name, p.tensor, p.tensor.sizes().vec(), 0, true});
  return out;
}

std::vector<GradGroup> WholeModel::grad_groups() const {
  GradGroup group;
  for (const auto& p : params_) group.params.push_back(p.tensor);
  return {group};
}

void WholeModel::for_each_full_parameter(const std::function<void(const std::string&, const at::Tensor&)>& visit) {
  for (const auto& p : params_) visit(p.name, p.tensor.detach());
}

}  // namespace fsdpp
