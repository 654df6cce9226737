// Model construction from the [model] section.
#include "train/model_source.h"

#include "core/error.h"
#include "core/log.h"
#include "core/module_tree.h"
#include "io/hf_dir.h"
#include "models/registry.h"
#include "core/config_file.h"


namespace fsdpp {

ModelSourceConfig ModelSourceConfig::from_section(ConfigSection& s) {
  ModelSourceConfig c;
  c.path = s.get_string("path", "");
  c.dtype = s.get_string("dtype", c.dtype);
  c.init_seed = static_cast<uint64_t>(s.get_int("init_seed", 0));
  s.finish();
  if (c.path.empty()) s.fail("path", "required: an HF model directory or config.json");
  try {
    parse_dtype(c.dtype);
  } catch (const UserError& e) {
    s.fail("dtype", e.what());
  }
  return c;
}

LoadedModel load_model(const ModelSourceConfig& config, bool defer_fresh_init) {
  const auto config_path = hf_config_path(config.path);
  const ModelConfig model_config = ModelConfig::from_file(config_path);
  const HfWeights weights = std::filesystem::is_directory(config.path)
                                ? HfWeights::open(config.path)
                                : HfWeights{};
  auto opts = torch::TensorOptions().dtype(parse_dtype(config.dtype));
  if (weights.empty() && defer_fresh_init) {
    auto model = build_model(model_config, opts.device(torch::kMeta));
    log_info("model: fresh ", model->class_name(), " (", model->recursive_param_count(),
             " parameters, seed ", config.init_seed, "), built unallocated");
    return {model, true};
  }
  auto model = build_model(model_config, opts);
  if (weights.empty()) {
    init_parameters(*model, config.init_seed, model_config.initializer_range);
    log_info("model: fresh ", model->class_name(), " (", model->recursive_param_count(),
             " parameters, seed ", config.init_seed, ")");
  } else {
    load_hf_weights(*model, weights);
    log_info("model: ", model->class_name(), " loaded from ", config.path, " (",
             model->recursive_param_count(), " parameters)");
  }
  return {model, false};
}

}  // namespace fsdpp
