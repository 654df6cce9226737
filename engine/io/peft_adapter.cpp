// Reading and writing PEFT LoRA adapters.
#include "io/peft_adapter.h"

#include "core/error.h"
#include "core/json_text.h"
#include "core/mapped_file.h"
#include "core/module_tree.h"
#include "io/safetensors.h"
#include "models/config_fields.h"
#include "models/lora.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string_view>

namespace fsdpp {

namespace {

constexpr const char* kConfigFile = "adapter_config.json";
constexpr const char* kWeightsFile = "adapter_model.safetensors";
// What an adapter's weights carry in their metadata beside PEFT's "format": a directory whose
// adapter lacks it was written by another program, and a run's adapter never replaces it.
const std::map<std::string, std::string> kAdapterMetadata = {{"format", "pt"}, {"written_by", "fsdpp adapter"}};

nlohmann::json read_adapter_config(const std::filesystem::path& path) {
  const nlohmann::json j = parse_json(read_text_file(path), path.string());
  if (!j.is_object()) throw UserError(path.string() + ": an adapter config must be a JSON object");
  const std::string origin = path.string();
  const auto peft_type = config_fields::read<std::string>(j, "peft_type", origin, "LORA");
  if (peft_type != "LORA") throw UserError(origin + ": peft_type '" + peft_type + "' is not LORA");
  for (const char* unsupported : {"use_dora", "use_rslora", "lora_bias"}) {
    if (config_fields::read<bool>(j, unsupported, origin, false)) {
      throw UserError(origin + ": " + unsupported + " = true is not supported");
    }
  }
  if (config_fields::read<std::string>(j, "bias", origin, "none") != "none") {
    throw UserError(origin + ": bias must be \"none\"");
  }
  for (const char* pattern : {"rank_pattern", "alpha_pattern"}) {
    if (j.contains(pattern) && !j[pattern].is_null() && !j[pattern].empty()) {
      throw UserError(path.string() + ": " + pattern + " is not supported (one rank and alpha for every target)");
    }
  }
  // Copies of layers the adapters would be put on, which the model has not.
  if (j.contains("layer_replication") && !j["layer_replication"].is_null()) {
    throw UserError(path.string() + ": layer_replication is not supported");
  }
  return j;
}

// The module a modules_to_save entry names that holds `tensor` (an engine name), if any: PEFT
// takes every module whose path ends with the entry, as text ("embed_tokens" names
// model.embed_tokens, "norm" every layer's input_layernorm too), the outermost where several do.
std::optional<std::string> saved_module_of(const std::string& tensor, const std::string& entry) {
  for (size_t dot = tensor.find('.'); dot != std::string::npos; dot = tensor.find('.', dot + 1)) {
    if (const std::string module = tensor.substr(0, dot); module.ends_with(entry)) return module;
  }
  return std::nullopt;
}

}  // namespace

PeftAdapter PeftAdapter::open(const std::filesystem::path& dir) {
  if (!std::filesystem::is_directory(dir)) throw UserError(dir.string() + ": no such adapter directory");
  const auto config_path = dir / kConfigFile;
  const nlohmann::json j = read_adapter_config(config_path);
  PeftAdapter adapter;
  adapter.dir_ = dir;
  if (!std::filesystem::exists(dir / kWeightsFile) && std::filesystem::exists(dir / "adapter_model.bin")) {
    throw UserError((dir / "adapter_model.bin").string() + ": a pickled adapter, which fsdpp does not read; save it "
                    "as " + kWeightsFile + " (peft's save_pretrained does by default)");
  }
  adapter.weights_ = SafetensorsFile::open(dir / kWeightsFile);
  LoraPlan& plan = adapter.plan_;
  plan.origin = config_path.string();
  try {
    plan.rank = j.at("r").get<int64_t>();
    plan.alpha = j.value("lora_alpha", 8.0);
    plan.dropout = j.value("lora_dropout", 0.0);
  } catch (const nlohmann::json::exception&) {
    throw UserError(config_path.string() + ": r, lora_alpha and lora_dropout must be numbers (r required)");
  }
  if (plan.rank < 1 || plan.rank > 65536) throw UserError(config_path.string() + ": r must be in [1, 65536]");
  if (!(plan.alpha > 0) || !(plan.dropout >= 0 && plan.dropout < 1)) {
    throw UserError(config_path.string() + ": lora_alpha must be positive and lora_dropout in [0, 1)");
  }
  std::vector<std::string> to_save;
  if (j.contains("modules_to_save") && j["modules_to_save"].is_array()) {
    for (const auto& m : j["modules_to_save"]) {
      if (!m.is_string()) throw UserError(config_path.string() + ": modules_to_save must list module names");
      to_save.push_back(engine_module_path(m.get<std::string>()));
    }
  }
  std::set<std::string> targets, saved;  // saved: the modules_to_save entries' modules, by path
  std::map<std::string, std::string> factor_of;  // module -> a factor it has, until its other one is found
  for (const auto& [name, entry] : adapter.weights_->entries()) {
    const std::string engine = engine_tensor_name(name);
    adapter.stored_[engine] = name;
    for (const std::string_view factor : {".lora_A.", ".lora_B."}) {
      const auto at = engine.find(factor);
      if (at == std::string::npos) continue;
      const std::string module = engine.substr(0, at);
      if (factor == ".lora_A.") targets.insert(module);
      // Each adapted module has both factors: one alone would be dropped without a word.
      if (!factor_of.erase(module)) factor_of[module] = name;
    }
    if (is_adapter_parameter(engine)) continue;
    std::optional<std::string> module;
    for (auto m = to_save.begin(); m != to_save.end() && !module; ++m) module = saved_module_of(engine, *m);
    if (!module) {
      throw UserError((dir / kWeightsFile).string() + ": tensor '" + name +
                      "' is neither a LoRA factor nor in modules_to_save");
    }
    saved.insert(*module);
  }
  if (!factor_of.empty()) {
    const std::string& alone = factor_of.begin()->second;
    const bool is_a = alone.find(".lora_A.") != std::string::npos;
    throw UserError((dir / kWeightsFile).string() + ": tensor '" + alone + "' has no " + (is_a ? "lora_B" : "lora_A") +
                    " beside it (" + std::to_string(factor_of.size()) + " module(s) with one factor alone); " +
                    "each adapted module needs both");
  }
  if (targets.empty()) throw UserError((dir / kWeightsFile).string() + ": holds no lora_A tensor");
  plan.targets.assign(targets.begin(), targets.end());
  plan.trainable.assign(saved.begin(), saved.end());
  return adapter;
}

bool PeftAdapter::holds(const std::string& name) const { return stored_.count(name) > 0; }

void PeftAdapter::check_shapes(Module& model) const {
  const std::string file = (dir_ / kWeightsFile).string();
  for (const auto& p : unique_named_parameters(model)) {
    if (!is_adapter_parameter(p.name) && !holds(p.name)) continue;
    if (!holds(p.name)) throw UserError(file + ": no tensor of the model's '" + p.name + "'");
    const std::string& stored = stored_.at(p.name);
    const std::vector<int64_t>& shape = weights_->entries().at(stored).shape;
    if (c10::IntArrayRef(shape) != p.tensor.sizes()) {
      throw UserError(file + ": tensor '" + stored + "' has shape " + c10::str(c10::IntArrayRef(shape)) +
                      ", the model's " + c10::str(p.tensor.sizes()));
    }
  }
}

ShardFill PeftAdapter::fill() const {
  return [weights = weights_, stored = stored_](const std::string& name, const at::Tensor& param, at::Tensor& rows,
                                               int64_t first_row) {
    const at::Tensor full = weights->tensor(stored.at(name));
    rows.view({rows.size(0), -1}).copy_(full.reshape({param.size(0), -1}).narrow(0, first_row, rows.size(0)));
  };
}

void check_adapter_target(const std::filesystem::path& dir, bool in_own_run_dir) {
  check_replaceable_dir(dir, "an adapter", [](const std::string& name) { return name == kConfigFile || name == kWeightsFile; });
  if (in_own_run_dir || !std::filesystem::exists(dir / kWeightsFile)) return;
  const auto mark = SafetensorsFile::open(dir / kWeightsFile)->metadata();
  const auto written_by = mark.find("written_by");
  if (written_by == mark.end() || written_by->second != kAdapterMetadata.at("written_by")) {
    throw UserError(dir.string() + ": holds an adapter that no fsdpp run wrote (" + kWeightsFile + " bears no run's "
                    "mark); an adapter replaces only an empty directory or an earlier one of a run: choose another "
                    "directory");
  }
}

void write_peft_adapter(const std::filesystem::path& dir, const LoraPlan& lora, const std::string& base_model,
                        const std::string& model_type, const NamedTensors& tensors, bool in_own_run_dir) {
  check_adapter_target(dir, in_own_run_dir);
  std::filesystem::create_directories(dir);
  NamedTensors stored;
  for (const auto& [name, tensor] : tensors) stored.emplace_back(peft_tensor_name(name, model_type), tensor);
  const auto module_paths = [&](const std::vector<std::string>& paths) {
    std::vector<std::string> mapped;
    for (const auto& path : paths) mapped.push_back(peft_module_path(path, model_type));
    return mapped;
  };
  write_safetensors(dir / kWeightsFile, stored, kAdapterMetadata);
  const nlohmann::json config = {{"peft_type", "LORA"}, {"task_type", "CAUSAL_LM"},
                                 {"base_model_name_or_path", base_model},
                                 {"r", lora.rank}, {"lora_alpha", lora.alpha}, {"lora_dropout", lora.dropout},
                                 {"target_modules", module_paths(lora.targets)}, {"bias", "none"},
                                 {"fan_in_fan_out", false},
                                 {"inference_mode", true}, {"use_rslora", false}, {"use_dora", false},
                                 {"init_lora_weights", true},
                                 {"modules_to_save", lora.trainable.empty() ? nlohmann::json()
                                                                            : nlohmann::json(module_paths(lora.trainable))}};
  AtomicFileWriter writer(dir / kConfigFile);
  const std::string text = config.dump(2) + "\n";
  writer.append(text.data(), text.size());
  writer.commit();
}

}  // namespace fsdpp
