// The sharded view of a model trained whole by one process: each parameter is its only
// shard, one gradient group holds them all, and nothing is ever gathered.
#pragma once

#include "fsdp/sharded_view.h"

namespace fsdpp {

class WholeModel : public ShardedView {
 public:
  explicit WholeModel(Module& model) : params_(unique_named_parameters(model)) {}

  std::vector<NamedParameter> sharded_parameters() const override { return params_; }
  std::vector<ShardRows> shard_rows() const override;
  std::vector<std::string> mesh_shapes() const override { return {"1x1"}; }
  std::vector<GradGroup> grad_groups() const override;
  void for_each_full_parameter(const std::function<void(const std::string&, const at::Tensor&)>& visit) override;
  // A whole model holds no gathered copies, and its gradients need no reduction.
  void reshard_all() override {}
  void set_requires_gradient_sync(bool) override {}

 private:
  std::vector<NamedParameter> params_;
};

}  // namespace fsdpp
