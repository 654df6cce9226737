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
// An adapter parameter's name in PEFT's adapter_model.safetensors, and back.
std::string peft_tensor_name(const std::string& name);
std::string engine_tensor_name(const std::string& peft_name);

}  // namespace fsdpp
