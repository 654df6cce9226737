// Traversal of engine module trees by dotted path.
#include "core/module_tree.h"

#include <ATen/CPUGeneratorImpl.h>

#include <functional>
#include <map>
#include <unordered_map>

namespace fsdpp {

namespace {

void walk(Module& module, const std::string& path, std::vector<ModuleEntry>& out) {
  out.push_back({path, &module});
  for (auto& [name, child] : module.named_child_modules()) {
    walk(*child, path.empty() ? name : path + "." + name, out);
  }
}

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

}  // namespace

std::vector<ModuleEntry> named_modules(Module& root) {
  std::vector<ModuleEntry> out;
  walk(root, "", out);
  return out;
}

std::vector<NamedParameter> unique_named_parameters(Module& root) {
  std::vector<NamedParameter> out;
  std::unordered_map<const void*, bool> seen;
  for (const auto& entry : named_modules(root)) {
    for (const auto& item : entry.module->named_parameters(/*recurse=*/false)) {
      if (seen.emplace(item.value().unsafeGetTensorImpl(), true).second) {
        out.push_back({join(entry.path, item.key()), item.value()});
      }
    }
  }
  return out;
}

std::map<std::string, at::ScalarType> written_dtypes(Module& root, at::ScalarType dtype) {
  std::map<std::string, at::ScalarType> dtypes;
  for (const auto& e : named_modules(root)) {
    const at::ScalarType written = e.module->keeps_float32() ? at::promote_types(dtype, at::kFloat) : dtype;
    for (const auto& item : e.module->named_parameters(/*recurse=*/false)) {
      dtypes.emplace(e.path.empty() ? item.key() : e.path + "." + item.key(), written);
    }
  }
  return dtypes;
}

std::vector<std::vector<std::string>> tied_parameter_groups(Module& root) {
  std::map<const void*, std::vector<std::string>> by_tensor;
  std::vector<const void*> order;
  for (const auto& entry : named_modules(root)) {
    for (const auto& item : entry.module->named_parameters(/*recurse=*/false)) {
      const void* impl = item.value().unsafeGetTensorImpl();
      auto& names = by_tensor[impl];
      if (names.empty()) order.push_back(impl);
      names.push_back(join(entry.path, item.key()));
    }
  }
  std::vector<std::vector<std::string>> groups;
  for (const void* impl : order) {
    if (by_tensor[impl].size() > 1) groups.push_back(by_tensor[impl]);
  }
  return groups;
}

bool path_under(const std::string& path, const std::string& prefix) {
  return prefix.empty() || path == prefix || path.starts_with(prefix + ".");
}

Module* find_module(Module& root, const std::string& path) {
  for (const auto& entry : named_modules(root)) {
    if (entry.path == path) return entry.module;
  }
  return nullptr;
}

at::Generator named_generator(uint64_t seed, const std::string& name) {
  // FNV-1a over the name, mixed with the seed: stable across platforms and builds.
  uint64_t h = 1469598103934665603ull ^ seed;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return at::make_generator<at::CPUGeneratorImpl>(h);
}

void init_parameters(Module& root, uint64_t seed, double std) {
  torch::NoGradGuard no_grad;
  // A tied tensor is initialised once, by the module that reaches it first.
  std::unordered_map<const void*, bool> done;
  for (const auto& entry : named_modules(root)) {
    for (auto& item : entry.module->named_parameters(/*recurse=*/false)) {
      if (!done.emplace(item.value().unsafeGetTensorImpl(), true).second) continue;
      at::Generator gen = named_generator(seed, join(entry.path, item.key()));
      entry.module->init_parameter(item.key(), item.value(), gen, std);
    }
  }
}

}  // namespace fsdpp
