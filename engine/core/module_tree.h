// Walking a model: every module with its dotted path (HF naming), parameters without
// aliases, tied-parameter groups, look-up by path, and seeded initialisation.
#pragma once

#include "core/module.h"

#include <map>
#include <string>
#include <vector>

namespace fsdpp {

struct ModuleEntry {
  std::string path;  // dotted, "" for the root
  Module* module;
};

struct NamedParameter {
  std::string name;  // dotted, as Hugging Face names it
  torch::Tensor tensor;
};

// Pre-order, the root first, children in registration order.
std::vector<ModuleEntry> named_modules(Module& root);

// Each parameter once, under the first name that reaches it (as PyTorch's
// named_parameters does, so a tied lm_head.weight is left out).
std::vector<NamedParameter> unique_named_parameters(Module& root);

// Groups of names that reach the same tensor; only groups of two or more.
std::vector<std::vector<std::string>> tied_parameter_groups(Module& root);

// The dtype a parameter is written in where the model is written in `dtype`: float32 at least
// for a parameter of a module that keeps float32 (Module::keeps_float32), as transformers
// saves it. By parameter name.
std::map<std::string, at::ScalarType> written_dtypes(Module& root, at::ScalarType dtype);

// Whether dotted `path` is `prefix` or lies below it ("" is above every path).
bool path_under(const std::string& path, const std::string& prefix);

// A module's dotted path as messages and plans show it: the root's "" as "<root>".
inline std::string module_label(const std::string& path) { return path.empty() ? "<root>" : path; }

// The module at a dotted path, or nullptr.
Module* find_module(Module& root, const std::string& path);

// Initialises every parameter the way Hugging Face does for a fresh model. Each parameter's
// values depend only on the seed and its own name, never on build order or world size.
void init_parameters(Module& root, uint64_t seed, double std);

// A generator seeded from (seed, name), shared by every initialiser.
at::Generator named_generator(uint64_t seed, const std::string& name);

}  // namespace fsdpp
