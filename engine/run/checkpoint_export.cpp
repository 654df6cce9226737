// The export streams tensor by tensor: the HF writer plans its files from the recorded
// shapes, and each tensor is assembled from its shards (a LoRA target's merged with its
// adapter), written and dropped.
#include "run/checkpoint_export.h"

#include "core/dtype.h"
#include "core/error.h"
#include "core/mapped_file.h"
#include "core/module_tree.h"
#include "io/hf_export.h"
#include "io/model_source.h"
#include "io/peft_adapter.h"
#include "io/sharded_checkpoint.h"
#include "models/lora.h"
#include "models/model_config.h"
#include "models/registry.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <unordered_set>

namespace fsdpp {

namespace {

// `config` with its output head untied, in every place its file ties it.
ModelConfig untied(const ModelConfig& config) {
  ModelConfig out = config;
  out.tie_word_embeddings = false;
  auto raw = std::make_shared<nlohmann::json>(config.raw ? *config.raw : nlohmann::json::object());
  (*raw)["tie_word_embeddings"] = false;
  if (raw->contains("text_config") && (*raw)["text_config"].is_object()) (*raw)["text_config"]["tie_word_embeddings"] = false;
  out.raw = raw;
  return out;
}

}  // namespace

ExportSummary export_checkpoint(const std::filesystem::path& dir, const std::filesystem::path& out,
                                std::optional<at::ScalarType> dtype, size_t max_shard_bytes, bool merge_lora) {
  if (path_within(out, dir) || path_within(dir, out)) {
    throw UserError("export: " + out.string() + " would overwrite or contain the checkpoint " + dir.string() +
                    " it reads; choose another OUT");
  }
  const auto opened = std::make_shared<const ShardedCheckpoint>(ShardedCheckpoint::open(dir));
  const ShardedCheckpoint& checkpoint = *opened;
  const ModelConfig config = ModelConfig::from_file(checkpoint.verified("config.json"));
  const nlohmann::json model_meta = checkpoint.metadata().value("model", nlohmann::json::object());
  const auto lora = model_meta.contains("lora") ? std::optional(model_meta["lora"].get<LoraPlan>()) : std::nullopt;
  if (lora && !merge_lora) {
    throw UserError("export: " + dir.string() + " holds LoRA adapters (a frozen base): pass --merge-lora for the " +
                    "merged model, or --adapter for its adapters in PEFT's layout");
  }
  if (!lora && merge_lora) throw UserError("export: --merge-lora, but " + dir.string() + " holds no LoRA adapters");
  const at::ScalarType run_dtype = parse_dtype(model_meta.value("dtype", "float32"));
  // The model the checkpoint was trained as, without memory: its parameters name and shape
  // the tensors, and a fresh base is initialised through it.
  const auto skeleton = build_model(config, at::TensorOptions().dtype(run_dtype).device(at::kMeta));
  if (lora) apply_lora(*skeleton, *lora, at::TensorOptions().dtype(run_dtype).device(at::kMeta));
  // An adapter-only checkpoint leaves the frozen base to the base it records, unchanged.
  const ShardFill base = recorded_base_fill(checkpoint, *skeleton);
  const ShardFill fill = checkpoint_fill(opened, base);
  const at::ScalarType out_dtype = dtype.value_or(run_dtype);
  constexpr std::string_view kPrefix = "model/";
  std::vector<TensorSpec> specs;
  std::map<std::string, NamedParameter> source_of;  // by exported name, the skeleton's parameter it holds
  const auto written = written_dtypes(*skeleton, out_dtype);
  const std::vector<NamedParameter> parameters = unique_named_parameters(*skeleton);
  // A tensor the model has not would be left out of the export without a word: refused, as a
  // resume refuses it.
  std::unordered_set<std::string> names;
  for (const auto& p : parameters) names.insert(p.name);
  for (const auto& key : checkpoint.keys(std::string(kPrefix))) {
    if (!names.contains(key.substr(kPrefix.size()))) {
      throw UserError(dir.string() + "/metadata.json: holds a tensor '" + key.substr(kPrefix.size()) + "' that a " +
                      config.model_type + " with its config.json has not (another architecture)");
    }
  }
  for (const auto& p : parameters) {
    // Every parameter the config's model has must be there: an HF directory without one
    // would load with that weight initialised at random.
    if (!checkpoint.contains(std::string(kPrefix) + p.name) && (!base || is_adapter_parameter(p.name))) {
      throw UserError(dir.string() + "/metadata.json: no tensor model/" + p.name + ", which a " + config.model_type +
                      " with its config.json has");
    }
    if (is_adapter_parameter(p.name)) continue;
    source_of.emplace(p.name, p);
    specs.push_back({p.name, written.at(p.name), p.tensor.sizes().vec()});
  }
  ModelConfig out_config = config;
  if (const auto head = lora ? adapted_tied_head(*skeleton, *lora) : std::nullopt) {
    source_of.emplace("lm_head.weight", source_of.at(*head));
    specs.push_back({"lm_head.weight", out_dtype, source_of.at(*head).tensor.sizes().vec()});
    out_config = untied(config);
  }
  // The tokenizer and generation config of the model the run was trained from, where it lies.
  HfDirWriter writer(out_config, specs, out, out_dtype, max_shard_bytes, model_meta.value("source", ""));
  ExportSummary summary{checkpoint.step(), 0, 0};
  for (const auto& spec : specs) {
    // In the masters' dtype, the checkpoint's rows as they were saved.
    at::Tensor tensor = at::empty(spec.shape, at::TensorOptions().dtype(master_dtype(run_dtype)));
    const NamedParameter& source = source_of.at(spec.name);
    fill(source.name, source.tensor, tensor, 0);
    const std::string module = spec.name.substr(0, spec.name.rfind('.'));
    if (lora && spec.name.ends_with(".weight") &&
        std::find(lora->targets.begin(), lora->targets.end(), module) != lora->targets.end()) {
      tensor = merged_lora_weight(tensor, checkpoint.read_full(std::string(kPrefix) + module + ".lora_A.weight"),
                                  checkpoint.read_full(std::string(kPrefix) + module + ".lora_B.weight"), *lora);
    }
    writer.write(spec.name, tensor);
    ++summary.tensors;
    summary.bytes += spec.bytes();
  }
  writer.finish();
  return summary;
}

ExportSummary export_adapter(const std::filesystem::path& dir, const std::filesystem::path& out,
                             std::optional<at::ScalarType> dtype) {
  if (path_within(out, dir) || path_within(dir, out)) {
    throw UserError("export: " + out.string() + " would overwrite or contain the checkpoint " + dir.string() +
                    " it reads; choose another OUT");
  }
  const ShardedCheckpoint checkpoint = ShardedCheckpoint::open(dir);
  const ModelConfig config = ModelConfig::from_file(checkpoint.verified("config.json"));
  const nlohmann::json model_meta = checkpoint.metadata().value("model", nlohmann::json::object());
  if (!model_meta.contains("lora")) throw UserError("export: --adapter, but " + dir.string() + " holds no LoRA adapters");
  const auto lora = model_meta["lora"].get<LoraPlan>();
  const at::ScalarType run_dtype = parse_dtype(model_meta.value("dtype", "float32"));
  const auto skeleton = build_model(config, at::TensorOptions().dtype(run_dtype).device(at::kMeta));
  apply_lora(*skeleton, lora, at::TensorOptions().dtype(run_dtype).device(at::kMeta));
  NamedTensors tensors;  // small next to the base: held whole until written, as at the run's end
  ExportSummary summary{checkpoint.step(), 0, 0};
  for (const auto& p : unique_named_parameters(*skeleton)) {
    const bool trainable = std::any_of(lora.trainable.begin(), lora.trainable.end(),
                                       [&](const std::string& m) { return path_under(p.name, m); });
    if (!is_adapter_parameter(p.name) && !trainable) continue;
    at::Tensor t = checkpoint.read_full("model/" + p.name);
    if (dtype) t = t.to(*dtype);
    summary.bytes += t.nbytes();
    ++summary.tensors;
    tensors.emplace_back(p.name, t);
  }
  write_peft_adapter(out, lora, model_meta.value("source", ""), config.model_type, tensors);
  return summary;
}

}  // namespace fsdpp
