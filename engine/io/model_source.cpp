// Model construction from the [model] section, whole or unallocated with a per-shard fill.
#include "io/model_source.h"

#include "core/error.h"
#include "core/log.h"
#include "core/name_list.h"
#include "core/module_tree.h"
#include "fsdp/fsdp_state.h"
#include "io/hf_dir.h"
#include "io/peft_adapter.h"
#include "io/sharded_checkpoint.h"
#include "models/lora.h"
#include "models/registry.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <unordered_map>

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

constexpr const char* kScoreWeight = "score.weight";

// A language model's weights under a sequence-classification config hold no score head:
// `base` for the rest, and the head drawn afresh as transformers draws it (normal, std
// initializer_range), from the seed and its name alone, so every rank and world size agree.
ShardFill with_fresh_score(ShardFill base, CausalLM& model, uint64_t seed) {
  ShardFill fresh = fresh_init_fill(model, seed, model.config().initializer_range);
  return [base = std::move(base), fresh](const std::string& name, const at::Tensor& param, at::Tensor& rows,
                                         int64_t first_row) {
    (name == kScoreWeight ? fresh : base)(name, param, rows, first_row);
  };
}

// `base` for the base model's parameters; adapter parameters (and the trainable base
// modules it saved) from `adapter` when given, else initialised as PEFT initialises them
// (from the seed and each one's name).
ShardFill with_adapters(ShardFill base, CausalLM& model, const std::optional<PeftAdapter>& adapter, uint64_t seed) {
  ShardFill adapters = adapter ? adapter->fill() : fresh_init_fill(model, seed, model.config().initializer_range);
  return [base = std::move(base), adapters, adapter](const std::string& name, const at::Tensor& param,
                                                     at::Tensor& rows, int64_t first_row) {
    const bool from_adapter = is_adapter_parameter(name) || (adapter && adapter->holds(name));
    (from_adapter ? adapters : base)(name, param, rows, first_row);
  };
}

// The policy's adapters where adapters are held already (`held`, by the file or checkpoint at
// `where`): the same rank, alpha and modules, or refused naming what differs. An adapter on a
// module the policy leaves out would be dropped without a word, and one the policy adds would
// start afresh beside trained ones.
void check_agrees(const LoraPlan& declared, const LoraPlan& held, const std::string& where) {
  if (declared.rank != held.rank || declared.alpha != held.alpha) {
    throw UserError(concat(where, ": r ", held.rank, ", lora_alpha ", held.alpha,
                           " differ from the policy's lora{rank = ", declared.rank, ", alpha = ", declared.alpha, "} at ",
                           declared.origin));
  }
  const auto only_in = [](const std::vector<std::string>& a, const std::vector<std::string>& b) {
    std::vector<std::string> left;
    for (const auto& name : a) {
      if (std::find(b.begin(), b.end(), name) == b.end()) left.push_back(name);
    }
    return left;
  };
  const auto named = [](const std::vector<std::string>& names) {
    return first_names(names, 1);
  };
  // The modules that train whole beside the adapters (PEFT's modules_to_save): one the policy
  // leaves out would load as trained and then stay frozen, one it adds would train from the base.
  const auto unsaved = only_in(held.trainable, declared.trainable), unheld = only_in(declared.trainable, held.trainable);
  if (!unsaved.empty() || !unheld.empty()) {
    throw UserError(where + ": trains " + (held.trainable.empty() ? "no module" : named(held.trainable)) +
                    " whole beside its adapters (modules_to_save), the policy's lora{...} at " + declared.origin + " " +
                    (declared.trainable.empty() ? "none" : named(declared.trainable)) +
                    " (lora_trainable must name the same modules)");
  }
  const auto dropped = only_in(held.targets, declared.targets), added = only_in(declared.targets, held.targets);
  if (!dropped.empty() || !added.empty()) {
    throw UserError(where + ": adapters on " + std::to_string(held.targets.size()) + " modules, the policy's " +
                    "lora{...} at " + declared.origin + " on " + std::to_string(declared.targets.size()) +
                    (dropped.empty() ? "" : "; the policy leaves out " + named(dropped)) +
                    (added.empty() ? "" : "; it has none on " + named(added)) +
                    " (lora_targets must name the adapters' modules)");
  }
}

// The adapters to put on: the policy's, which config.adapter must then agree with, or
// config.adapter's own.
std::optional<LoraPlan> adapters_to_apply(const LoraPlan* declared, const std::optional<PeftAdapter>& adapter) {
  if (!adapter) return declared ? std::optional(*declared) : std::nullopt;
  if (!declared) return adapter->plan();
  check_agrees(*declared, adapter->plan(), adapter->plan().origin);
  return *declared;
}

void fill_whole(CausalLM& model, const ShardFill& fill) {
  at::NoGradGuard no_grad;
  for (auto& [name, param] : unique_named_parameters(model)) fill(name, param, param, 0);
}

}  // namespace

ShardFill recorded_base_fill(const ShardedCheckpoint& checkpoint, CausalLM& model) {
  const auto meta = checkpoint.metadata().value("model", nlohmann::json::object());
  if (!meta.contains("base")) return {};
  const auto recorded = meta["base"].get<BaseIdentity>();
  const uint64_t seed = recorded.init_seed.value_or(0);  // a fresh base's
  recorded.check_same(BaseIdentity::of(recorded.path, seed), checkpoint.dir().string());
  const std::filesystem::path& path = recorded.path;
  auto weights = std::make_shared<const HfWeights>(HfWeights::of_model_path(path));
  if (weights->empty()) return fresh_init_fill(model, seed, model.config().initializer_range);
  weights->advise_random();
  return hf_fill(weights, model);
}

ShardFill checkpoint_fill(std::shared_ptr<const ShardedCheckpoint> checkpoint, ShardFill base) {
  // Only an adapter-only checkpoint (one recording its base) may leave tensors out.
  if (!checkpoint->metadata().value("model", nlohmann::json::object()).contains("base")) base = {};
  return [checkpoint, base](const std::string& name, const at::Tensor& param, at::Tensor& rows, int64_t first_row) {
    const std::string key = "model/" + name;
    if (base && !checkpoint->contains(key)) return base(name, param, rows, first_row);
    // Rows of a tensor of another shape could read in range and fill a run of another
    // architecture without a word.
    if (const auto& saved = checkpoint->record(key).shape; saved != param.sizes()) {
      throw UserError(checkpoint->dir().string() + ": tensor '" + name + "' is " + c10::str(c10::IntArrayRef(saved)) +
                      " there but " + c10::str(param.sizes()) + " in this run (another architecture)");
    }
    checkpoint->read_rows(key, rows, first_row);
  };
}

ModelConfig model_config_of(const ModelSourceConfig& config) {
  if (ShardedCheckpoint::is_checkpoint(config.path)) {
    return ModelConfig::from_file(ShardedCheckpoint::open(config.path).verified("config.json"));
  }
  return ModelConfig::from_file(hf_config_path(config.path));
}

BaseIdentity base_identity_of(const ModelSourceConfig& config) {
  if (ShardedCheckpoint::is_checkpoint(config.path)) {
    const auto meta = ShardedCheckpoint::open(config.path).metadata().value("model", nlohmann::json::object());
    if (meta.contains("base")) return meta["base"].get<BaseIdentity>();
  }
  return BaseIdentity::of(config.path, config.init_seed);
}

std::filesystem::path model_files_dir(const ModelSourceConfig& config) {
  namespace fs = std::filesystem;
  if (ShardedCheckpoint::is_checkpoint(config.path)) {
    return ShardedCheckpoint::open(config.path).metadata().value("model", nlohmann::json::object()).value("source", "");
  }
  const fs::path path = fs::absolute(config.path).lexically_normal();
  return fs::is_directory(path) ? path : path.parent_path();
}

std::optional<LoraPlan> adapters_to_put_on(const ModelSourceConfig& config, const LoraPlan* lora) {
  return adapters_to_apply(lora, config.adapter.empty() ? std::nullopt
                                                        : std::optional(PeftAdapter::open(config.adapter)));
}

LoadedModel load_model(const ModelSourceConfig& config, bool unallocated, const LoraPlan* lora,
                       const std::string& resumed_from) {
  auto opts = torch::TensorOptions().dtype(config.dtype);
  if (unallocated) opts = opts.device(torch::kMeta);
  const auto adapter = config.adapter.empty() ? std::nullopt : std::optional(PeftAdapter::open(config.adapter));
  LoadedModel loaded;
  loaded.lora = adapters_to_apply(lora, adapter);
  const bool from_checkpoint = ShardedCheckpoint::is_checkpoint(config.path);
  std::shared_ptr<const ShardedCheckpoint> checkpoint;
  if (from_checkpoint) {
    checkpoint = std::make_shared<const ShardedCheckpoint>(ShardedCheckpoint::open(config.path));
    // A LoRA run's checkpoint carries its adapters (config.adapter replaces them); a policy
    // that declares adapters must declare those.
    const auto meta = checkpoint->metadata().value("model", nlohmann::json::object());
    // Adapters train over a base that lies in files of its own, recorded by their checksums
    // (BaseIdentity); a checkpoint's full model is that base once exported.
    if (loaded.lora && !meta.contains("lora")) {
      throw UserError(checkpoint->dir().string() + ": a checkpoint of a run without adapters, as the base of adapters; "
                      "export it (fsdpp export " + checkpoint->dir().string() + " OUT) and name OUT in [model] path");
    }
    if (meta.contains("lora") && adapter) {
      log_warn(checkpoint->dir().string(), ": the adapters it holds are set aside for [model] adapter ", config.adapter,
               "'s, put on the base it records");
    }
    if (meta.contains("lora") && !adapter) {
      const auto held = meta["lora"].get<LoraPlan>();
      if (loaded.lora) {
        check_agrees(*loaded.lora, held, checkpoint->dir().string());
      } else {
        loaded.lora = held;
      }
    }
  }
  auto build = [&](const ModelConfig& model_config) {
    loaded.model = build_model(model_config, opts);
    if (loaded.lora) apply_lora(*loaded.model, *loaded.lora, opts);
    if (adapter) adapter->check_shapes(*loaded.model);  // before any rank reads a row
  };
  std::string source;  // for the log, once the values are in
  if (from_checkpoint) {
    build(ModelConfig::from_file(checkpoint->verified("config.json")));
    // A checkpoint of a LoRA run holds its adapters (config.adapter replaces them), and the
    // base it leaves out comes from the base it records, checked to be unchanged.
    loaded.fill = checkpoint_fill(checkpoint, recorded_base_fill(*checkpoint, *loaded.model));
    if (adapter) loaded.fill = with_adapters(loaded.fill, *loaded.model, adapter, config.init_seed);
    source = "from checkpoint " + config.path + " (step " + std::to_string(checkpoint->step()) + ", ";
  } else {
    const ModelConfig model_config = ModelConfig::from_file(hf_config_path(config.path));
    auto weights = std::make_shared<const HfWeights>(HfWeights::of_model_path(config.path));
    build(model_config);
    if (weights->empty()) {
      loaded.fill = fresh_init_fill(*loaded.model, config.init_seed, model_config.initializer_range);
      source = "fresh (seed " + std::to_string(config.init_seed) + ", ";
    } else {
      check_tied_copies_agree(*loaded.model, *weights);
      if (unallocated) weights->advise_random();
      loaded.weights = weights;
      loaded.fill = hf_fill(weights, *loaded.model);
      source = std::string("from ") + config.path + (unallocated ? " (each rank reading its rows, " : " (");
      if (model_config.num_labels > 0 && !weights->contains(kScoreWeight)) {
        loaded.fill = with_fresh_score(loaded.fill, *loaded.model, config.init_seed);
        source += std::string(kScoreWeight) + " drawn afresh, ";
      }
    }
    if (loaded.lora) loaded.fill = with_adapters(loaded.fill, *loaded.model, adapter, config.init_seed);
  }
  if (!unallocated) {
    fill_whole(*loaded.model, loaded.fill);
    loaded.fill = {};
    if (const std::string found = first_non_finite(unique_named_parameters(*loaded.model)); !found.empty()) {
      throw UserError((from_checkpoint ? config.path : "[model] path " + config.path) + ": parameter '" + found +
                      "' holds NaN or inf: the weights are not finite");
    }
    // Once every tensor the model needs was found: files of other names fail on one line first.
    if (loaded.weights) warn_unused_hf_tensors(*loaded.model, *loaded.weights);
    loaded.weights.reset();
  }
  if (!resumed_from.empty()) source = "from checkpoint " + resumed_from + " (resumed, ";
  log_info("model: ", loaded.model->class_name(), " ", source, loaded.model->recursive_param_count(), " parameters",
           loaded.lora ? ", LoRA rank " + std::to_string(loaded.lora->rank) + " on " +
                             std::to_string(loaded.lora->targets.size()) + " modules" : std::string(),
           config.adapter.empty() ? std::string() : " from " + config.adapter, ")");
  return loaded;
}

std::string first_non_finite(const std::vector<NamedParameter>& named) {
  // Each tensor's largest magnitude, NaN where it holds one, in one fused call and one read per
  // device: a model of tens of thousands of tensors reads no flag back one at a time.
  std::unordered_map<c10::Device, std::pair<std::vector<std::string>, std::vector<at::Tensor>>> by_device;
  for (const auto& [name, tensor] : named) {
    if (tensor.numel() == 0) continue;
    auto& [names, tensors] = by_device[tensor.device()];
    names.push_back(name);
    tensors.push_back(tensor);
  }
  std::string found;
  for (const auto& [device, group] : by_device) {
    const at::Tensor finite = at::stack(at::_foreach_norm(group.second, INFINITY)).isfinite().cpu();  // [tensors]
    const auto flags = finite.accessor<bool, 1>();
    for (int64_t i = 0; i < flags.size(0) && found.empty(); ++i) {
      if (!flags[i]) found = group.first[static_cast<size_t>(i)];
    }
  }
  return found;
}

}  // namespace fsdpp
