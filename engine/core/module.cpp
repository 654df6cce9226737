// Hook bookkeeping and parameter counts for the engine's module base.
#include "core/module.h"

#include <algorithm>
#include <unordered_set>

namespace fsdpp {

Module::Module(std::string class_name) : class_name_(std::move(class_name)) {}

std::vector<std::pair<std::string, Module*>> Module::named_child_modules() const {
  std::vector<std::pair<std::string, Module*>> children;
  for (const auto& item : named_children()) {
    auto* child = dynamic_cast<Module*>(item.value().get());
    TORCH_CHECK(child != nullptr, "child '", item.key(), "' of ", class_name_,
                " is not an fsdpp::Module");
    children.emplace_back(item.key(), child);
  }
  return children;
}

torch::Tensor new_parameter(at::IntArrayRef shape, const torch::TensorOptions& opts) {
  if (!opts.device().is_meta()) return torch::empty(shape, opts);
  return unallocated_tensor(shape, opts.device(torch::kCPU));
}

torch::Tensor unallocated_tensor(at::IntArrayRef shape, const torch::TensorOptions& opts) {
  auto t = torch::empty({0}, opts);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return t;
}

bool is_allocated(const torch::Tensor& t) {
  return t.storage().nbytes() >= static_cast<size_t>(t.numel() * t.element_size());
}

int Module::add_pre_forward_hook(PreForwardHook hook) {
  pre_hooks_.emplace_back(next_hook_id_, std::move(hook));
  return next_hook_id_++;
}

int Module::add_post_forward_hook(PostForwardHook hook) {
  post_hooks_.emplace_back(next_hook_id_, std::move(hook));
  return next_hook_id_++;
}

void Module::remove_hook(int id) {
  std::erase_if(pre_hooks_, [id](const auto& h) { return h.first == id; });
  std::erase_if(post_hooks_, [id](const auto& h) { return h.first == id; });
}

void Module::run_pre_forward_hooks(Tensors& inputs) {
  for (auto& [id, hook] : pre_hooks_) hook(*this, inputs);
}

void Module::run_post_forward_hooks(torch::Tensor& output) {
  for (auto& [id, hook] : post_hooks_) hook(*this, output);
}

int64_t Module::own_param_count() const {
  int64_t count = 0;
  for (const auto& p : parameters(/*recurse=*/false)) count += p.numel();
  return count;
}

int64_t Module::recursive_param_count() const {
  std::unordered_set<const void*> seen;
  int64_t count = 0;
  for (const auto& p : parameters(/*recurse=*/true)) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) count += p.numel();
  }
  return count;
}

void Module::init_parameter(const std::string& local_name, torch::Tensor&, at::Generator&,
                            double) {
  TORCH_CHECK(false, class_name_, " has no initialiser for its parameter '", local_name, "'");
}

}  // namespace fsdpp
