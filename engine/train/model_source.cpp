// Model construction from the [model] section, whole or unallocated with a per-shard fill.
#include "train/model_source.h"

#include "core/error.h"
#include "core/log.h"
#include "core/module_tree.h"
#include "fsdp/fsdp_state.h"
#include "io/hf_dir.h"
#include "io/sharded_checkpoint.h"
#include "models/registry.h"

#include <ATen/ATen.h>

#include <map>

namespace fsdpp {

namespace {

// Rows of HF weights, read through the parameter's dtype as a materialised model would hold
// them; a tied parameter missing from the files is found under its aliases.
ShardFill hf_fill(std::shared_ptr<const HfWeights> weights, CausalLM& model) {
  std::map<std::string, std::vector<std::string>> aliases;
  for (const auto& group : tied_parameter_groups(model)) {
    for (const auto& name : group) aliases[name] = group;
  }
  return [weights, aliases](const std::string& name, const at::Tensor& param, at::Tensor& rows, int64_t first_row) {
    auto it = aliases.find(name);
    std::vector<std::string> names{name};
    if (it != aliases.end()) names.insert(names.end(), it->second.begin(), it->second.end());
    at::Tensor staged = at::empty(rows.sizes(), param.options());
    read_hf_rows(*weights, names, param.sizes(), staged, first_row);
    rows.copy_(staged);
  };
}

void fill_whole(CausalLM& model, const ShardFill& fill) {
  at::NoGradGuard no_grad;
  for (auto& [name, param] : unique_named_parameters(model)) fill(name, param, param, 0);
}

}  // namespace

ShardFill checkpoint_fill(std::shared_ptr<const ShardedCheckpoint> checkpoint) {
  return [checkpoint](const std::string& name, const at::Tensor&, at::Tensor& rows, int64_t first_row) {
    checkpoint->read_rows("model/" + name, rows, first_row);
  };
}

ModelConfig model_config_of(const ModelSourceConfig& config) {
  if (ShardedCheckpoint::is_checkpoint(config.path)) {
    return ModelConfig::from_file(ShardedCheckpoint::open(config.path).verified("config.json"));
  }
  return ModelConfig::from_file(hf_config_path(config.path));
}

LoadedModel load_model(const ModelSourceConfig& config, bool unallocated) {
  auto opts = torch::TensorOptions().dtype(parse_dtype(config.dtype));
  if (unallocated) opts = opts.device(torch::kMeta);
  LoadedModel loaded;
  if (ShardedCheckpoint::is_checkpoint(config.path)) {
    auto checkpoint = std::make_shared<const ShardedCheckpoint>(ShardedCheckpoint::open(config.path));
    loaded.model = build_model(ModelConfig::from_file(checkpoint->verified("config.json")), opts);
    loaded.fill = checkpoint_fill(checkpoint);
    log_info("model: ", loaded.model->class_name(), " from checkpoint ", config.path, " (step ", checkpoint->step(),
             ", ", loaded.model->recursive_param_count(), " parameters)");
  } else {
    const ModelConfig model_config = ModelConfig::from_file(hf_config_path(config.path));
    auto weights = std::make_shared<const HfWeights>(
        std::filesystem::is_directory(config.path) ? HfWeights::open(config.path) : HfWeights{});
    loaded.model = build_model(model_config, opts);
    if (weights->empty()) {
      if (unallocated) {
        loaded.fill = fresh_init_fill(*loaded.model, config.init_seed, model_config.initializer_range);
      } else {
        init_parameters(*loaded.model, config.init_seed, model_config.initializer_range);
      }
      log_info("model: fresh ", loaded.model->class_name(), " (", loaded.model->recursive_param_count(),
               " parameters, seed ", config.init_seed, ")");
    } else if (unallocated) {
      weights->advise_random();
      loaded.fill = hf_fill(weights, *loaded.model);
      loaded.weights = weights;
      log_info("model: ", loaded.model->class_name(), " from ", config.path, " (",
               loaded.model->recursive_param_count(), " parameters, each rank reading its rows)");
    } else {
      load_hf_weights(*loaded.model, *weights);  // also warns of tensors the model lacks
      log_info("model: ", loaded.model->class_name(), " loaded from ", config.path, " (",
               loaded.model->recursive_param_count(), " parameters)");
    }
  }
  if (!unallocated && loaded.fill) {
    fill_whole(*loaded.model, loaded.fill);
    loaded.fill = {};
  }
  return loaded;
}

}  // namespace fsdpp
