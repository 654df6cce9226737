// LoRA on a built model: adapters on the Linear modules a plan names, the rest of the base
// frozen, and the names PEFT gives adapter tensors in its files.
#pragma once

#include "models/causal_lm.h"
#include "models/lora_plan.h"

#include <optional>
#include <string>

namespace fsdpp {

// Adds an adapter to every target of `lora` (each must be a Linear) and freezes every base
// parameter outside the trainable modules; adapters train. UserErrors name lora.origin and
// the path at fault.
void apply_lora(CausalLM& model, const LoraPlan& lora, const torch::TensorOptions& opts);

// A target's weight [out, in] with its adapter merged in: base + B A × alpha / rank, in
// float64 so the merge adds no rounding of its own (factors A [rank, in], B [out, rank]).
at::Tensor merged_lora_weight(const at::Tensor& base, const at::Tensor& a, const at::Tensor& b, const LoraPlan& lora);

// Where `lora` adapts the output head of a model that ties it to its embedding: the
// embedding's parameter name. The adapter changes the head alone, so the merged model's head
// is a weight of its own (lm_head.weight, the embedding's values merged) and its config unties them.
std::optional<std::string> adapted_tied_head(Module& model, const LoraPlan& lora);

// Whether a parameter name is an adapter's ("...q_proj.lora_A.weight").
bool is_adapter_parameter(const std::string& name);
// PEFT names what it adapts by transformers' module paths. Those of Qwen2-VL and Qwen2.5-VL
// (by `model_type`) keep the language model under model.language_model and the vision tower
// under model.visual, where their checkpoints and the engine say model and visual. A module's
// path (a target, a module saved whole) and an adapter tensor's name in PEFT's files:
std::string peft_module_path(const std::string& path, const std::string& model_type);
std::string peft_tensor_name(const std::string& name, const std::string& model_type);
// And back, from either naming (adapters written before transformers 5 use the checkpoint's).
std::string engine_module_path(const std::string& peft_path);
std::string engine_tensor_name(const std::string& peft_name);

}  // namespace fsdpp
