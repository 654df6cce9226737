// The [model] section: which architecture to build and where its weights come from (an HF
// directory, a sharded checkpoint, or a fresh initialisation from a config.json).
#pragma once

#include "core/dtype.h"
#include "core/module_tree.h"
#include "fsdp/plan.h"
#include "fsdp/sharded_param.h"
#include "io/hf_dir.h"
#include "io/model_source_config.h"
#include "models/causal_lm.h"

#include <memory>
#include <optional>
#include <string>

namespace fsdpp {

class HfWeights;
class ShardedCheckpoint;

struct LoadedModel {
  std::shared_ptr<CausalLM> model;
  std::optional<LoraPlan> lora;  // the adapters the model carries, if any
  // Set when the model was built unallocated: gives each rank's rows of every parameter
  // (read straight from the weight files, or initialised) as the sharding asks for them.
  ShardFill fill;
  std::shared_ptr<const HfWeights> weights;  // the mapped HF files behind `fill`, if any
};

// Builds the model with its values. With `unallocated` it is built without memory and
// `fill` supplies the values shard by shard (FSDP); otherwise every parameter is filled.
// LoRA adapters go on as `lora` (a policy's lora{...}) says, or when it is null as
// config.adapter's own config or a LoRA run's checkpoint records them; their values come
// from config.adapter or the checkpoint, or are initialised as PEFT initialises them.
// `resumed_from` names the checkpoint whose values a resumed run puts over the ones loaded
// here, for the log line to say so.
LoadedModel load_model(const ModelSourceConfig& config, bool unallocated = false, const LoraPlan* lora = nullptr,
                       const std::string& resumed_from = "");
// The adapters load_model puts on from `lora` and config.adapter (its config and its tensors'
// header read, no values), for a plan of the run; refused as load_model refuses them.
std::optional<LoraPlan> adapters_to_put_on(const ModelSourceConfig& config, const LoraPlan* lora);
// The architecture alone, read without building the model.
ModelConfig model_config_of(const ModelSourceConfig& config);
// The directory whose tokenizer, chat template and generation config go with the model, as
// an absolute path: an HF directory itself, a bare config.json's directory, or the one a
// checkpoint records of the model it was trained from ("" when it records none).
std::filesystem::path model_files_dir(const ModelSourceConfig& config);

// The base a LoRA run's adapters go on: the HF directory (or fresh base) config.path names,
// or the base an adapter-only checkpoint there records.
BaseIdentity base_identity_of(const ModelSourceConfig& config);
// The rows of the base an adapter-only checkpoint records (read from its HF files, or
// initialised from the seed of a fresh base), once checked to be unchanged; none for a
// checkpoint that holds the whole model. `model` has the checkpoint's architecture.
ShardFill recorded_base_fill(const ShardedCheckpoint& checkpoint, CausalLM& model);
// Parameter rows from a checkpoint's saved masters ("model/<name>"); those it does not hold
// (the frozen base an adapter-only checkpoint leaves out) from `base`.
ShardFill checkpoint_fill(std::shared_ptr<const ShardedCheckpoint> checkpoint, ShardFill base = {});

// The name of a tensor of `named` that holds NaN or inf ("" where all are finite): weights that
// would train nothing, every step's gradient norm not finite.
std::string first_non_finite(const std::vector<NamedParameter>& named);

}  // namespace fsdpp
