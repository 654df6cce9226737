// The interface every language model offers the trainer: token ids in, logits out, plus
// what wrap policies read (config, no_split_modules).
#pragma once

#include "core/module.h"
#include "models/model_config.h"

#include <string>
#include <vector>

namespace fsdpp {

class CausalLM : public Module {
 public:
  CausalLM(std::string class_name, ModelConfig config, std::vector<std::string> no_split)
      : Module(std::move(class_name)), config_(std::move(config)), no_split_(std::move(no_split)) {}

  FSDPP_MODULE_CALL
  virtual torch::Tensor forward(const torch::Tensor& input_ids) = 0;  // [B, T] -> [B, T, V]

  const ModelConfig& config() const { return config_; }
  // Classes that must stay whole inside one unit (Hugging Face's _no_split_modules).
  const std::vector<std::string>& no_split_modules() const { return no_split_; }

 private:
  ModelConfig config_;
  std::vector<std::string> no_split_;
};

}  // namespace fsdpp
