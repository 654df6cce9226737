// Maps a config.json's model_type to the builder of its model.
#pragma once

#include "models/causal_lm.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace fsdpp {

using ModelBuilder =
    std::function<std::shared_ptr<CausalLM>(const ModelConfig&, const torch::TensorOptions&)>;

// Builds the model with uninitialised parameters of `opts` (dtype, device; "meta" allocates
// nothing: see new_parameter). An unknown model_type is a UserError listing the known ones.
std::shared_ptr<CausalLM> build_model(const ModelConfig& config, const torch::TensorOptions& opts);

std::vector<std::string> registered_model_types();

// The transformers class of `config`'s model ("LlamaForCausalLM"), which config.json's
// `architectures` names and serving engines pick the model by.
std::string architecture_of(const ModelConfig& config);

}  // namespace fsdpp
