// The base of every engine module: a torch::nn::Module that carries its class name as
// Hugging Face spells it and runs pre- and post-forward hooks around forward, as Python's
// nn.Module.__call__ does (LibTorch's C++ modules have none, and FSDP needs them).
// Models call children only through operator(), never child->forward(...).
#pragma once

#include "core/error.h"
#include "core/recompute.h"

#include <torch/nn/module.h>

#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace fsdpp {

class Module : public torch::nn::Module {
 public:
  using Tensors = std::vector<torch::Tensor>;
  // A pre-forward hook sees the call's tensor arguments, in order, and may replace them.
  using PreForwardHook = std::function<void(Module&, Tensors& inputs)>;
  // A post-forward hook sees the forward's output and may replace it.
  using PostForwardHook = std::function<void(Module&, torch::Tensor& output)>;

  explicit Module(std::string class_name);

  const std::string& class_name() const { return class_name_; }
  Module* parent() const { return parent_; }
  std::vector<std::pair<std::string, Module*>> named_child_modules() const;

  // Hooks run in the order they were added; the returned id removes one.
  int add_pre_forward_hook(PreForwardHook hook);
  int add_post_forward_hook(PostForwardHook hook);
  void remove_hook(int id);

  // Recompute this module's forward in backward instead of keeping its activations. Only
  // for modules whose forward takes tensors alone (a decoder layer), so the recomputation
  // holds no dangling argument.
  void set_activation_checkpointing(bool on) { checkpoint_ = on; }

  // Whether calling this module runs its forward alone (no hook, no recomputation), so that
  // an owner may compute it by other means (Experts' grouped product of many MLPs).
  bool calls_forward_alone() const { return pre_hooks_.empty() && post_hooks_.empty() && !checkpoint_; }

  // Parameters registered on this module itself, and on its whole subtree (a parameter
  // reachable under two names, such as tied embeddings, counts once).
  int64_t own_param_count() const;
  int64_t recursive_param_count() const;

  // True for the container of a MoE layer's routed experts: plans count what it holds as
  // expert parameters, and policies find its class in ctx.expert_modules.
  virtual bool routed_experts() const { return false; }

  // True for a frozen parameter (by its local name) that the run still moves outside the
  // optimizer (a routing bias): it keeps a full-precision master where other frozen
  // parameters are held only in the dtype they compute in.
  virtual bool updated_without_gradient(const std::string& /*local_name*/) const { return false; }

  // True for a container (ModuleList, Sequential): its owner calls each child, so it has no
  // forward of its own, and a unit can never gather around it (policies: ctx.container_modules).
  virtual bool is_container() const { return false; }

  // True for a module whose parameters its transformers class keeps in float32 whatever the
  // model's dtype (DeepSeek-V3's router): exports write them in float32, and the shipped
  // policies gather them so (ctx.float32_modules).
  virtual bool keeps_float32() const { return false; }

  // Fills one of this module's own parameters (by its local name) for a fresh model,
  // drawing from `gen`; modules that own parameters override it.
  virtual void init_parameter(const std::string& local_name, torch::Tensor& tensor,
                              at::Generator& gen, double std);

 protected:
  template <class T>
  std::shared_ptr<T> register_child(const std::string& name, std::shared_ptr<T> child) {
    child->parent_ = this;
    return register_module(name, std::move(child));
  }

  // The call operator of a derived module: hooks around Derived::forward(args...).
  template <class Derived, class... Args>
  torch::Tensor call_forward(Derived& self, Args&&... args);

 private:
  void run_pre_forward_hooks(Tensors& inputs);
  void run_post_forward_hooks(torch::Tensor& output);

  std::string class_name_;
  Module* parent_ = nullptr;
  bool checkpoint_ = false;
  std::vector<std::pair<int, PreForwardHook>> pre_hooks_;
  std::vector<std::pair<int, PostForwardHook>> post_hooks_;
  int next_hook_id_ = 0;
};

// A parameter tensor of `shape`. For the meta device it is a CPU tensor whose storage holds
// no bytes yet: the state FSDP keeps sharded parameters in, so a model of any size builds
// without memory and each rank later allocates only its own shards.
torch::Tensor new_parameter(at::IntArrayRef shape, const torch::TensorOptions& opts);
// A tensor of `shape` on opts' device whose storage holds no bytes until it is given some.
torch::Tensor unallocated_tensor(at::IntArrayRef shape, const torch::TensorOptions& opts);
// Whether the tensor's storage holds all its bytes.
bool is_allocated(const torch::Tensor& t);

// nn.Sequential as Hugging Face models name it: children under their indices, with gaps
// where an activation without parameters sits; the owner calls them in turn.
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  bool is_container() const override { return true; }
  template <class T>
  std::shared_ptr<T> add(int64_t index, std::shared_ptr<T> child) {
    return register_child(std::to_string(index), std::move(child));
  }
};

// A container whose children are named 0, 1, 2, ... (nn.ModuleList in Hugging Face models).
class ModuleList : public Module {
 public:
  ModuleList() : Module("ModuleList") {}
  bool is_container() const override { return true; }
  template <class T>
  std::shared_ptr<T> append(std::shared_ptr<T> child) {
    return register_child(std::to_string(size_++), std::move(child));
  }

 private:
  size_t size_ = 0;
};

// Defines operator() for a module class whose forward takes ARGS...; tensor arguments pass
// through the pre-forward hooks.
#define FSDPP_MODULE_CALL                                                  \
  template <class... Args>                                                 \
  torch::Tensor operator()(Args&&... args) {                               \
    return call_forward(*this, std::forward<Args>(args)...);               \
  }

template <class Derived, class... Args>
torch::Tensor Module::call_forward(Derived& self, Args&&... args) {
  if (calls_forward_alone()) {
    return self.forward(std::forward<Args>(args)...);
  }
  Tensors inputs;
  auto collect = [&inputs](const auto& arg) {
    if constexpr (std::is_same_v<std::decay_t<decltype(arg)>, torch::Tensor>) {
      inputs.push_back(arg);
    }
  };
  (collect(args), ...);
  run_pre_forward_hooks(inputs);
  // Braced initialisation is sequenced left to right, so tensors are taken back in order.
  size_t next = 0;
  auto pick = [&inputs, &next](auto&& arg) -> decltype(auto) {
    if constexpr (std::is_same_v<std::decay_t<decltype(arg)>, torch::Tensor>) {
      return torch::Tensor(inputs[next++]);
    } else {
      return std::forward<decltype(arg)>(arg);
    }
  };
  using Picked = std::tuple<std::conditional_t<
      std::is_same_v<std::decay_t<Args>, torch::Tensor>, torch::Tensor, Args&&>...>;
  Picked picked{pick(std::forward<Args>(args))...};
  torch::Tensor output;
  constexpr bool all_tensors = (std::is_same_v<std::decay_t<Args>, torch::Tensor> && ...);
  if constexpr (all_tensors) {
    if (checkpoint_ && at::GradMode::is_enabled()) {
      output = recomputed_in_backward(inputs, [&self](const Tensors& in) {
        return [&]<size_t... I>(std::index_sequence<I...>) { return self.forward(in[I]...); }(
            std::index_sequence_for<Args...>{});
      });
    }
  } else {
    if (checkpoint_) {
      throw UserError(class_name_ + ": activation checkpointing needs a forward of tensors only, and this one takes "
                      "others; checkpoint the module around it");
    }
  }
  if (!output.defined()) {
    output = std::apply([&self](auto&&... a) { return self.forward(std::forward<decltype(a)>(a)...); },
                        std::move(picked));
  }
  run_post_forward_hooks(output);
  return output;
}

}  // namespace fsdpp
