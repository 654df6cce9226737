// The [experts] section: how training balances a mixture-of-experts model's routing beyond
// what the model's own config asks for (Qwen3-MoE's load-balancing loss comes from there).
#pragma once

#include <string>

namespace fsdpp {

class ConfigSection;
struct ModelConfig;

struct ExpertsConfig {
  // DeepSeek-V3's auxiliary-loss-free balancing: after each step, every routing bias
  // (e_score_correction_bias) moves by this much toward balance, up for experts that got
  // fewer tokens than their layer's mean over the step and all ranks, down for those that
  // got more; 0: the biases stay as loaded.
  double bias_update_rate = 0.0;

  static ExpertsConfig from_section(ConfigSection& section);
  // A UserError naming `origin` when this asks of `model` what it cannot do (a bias update
  // for routers without biases).
  void check_model(const ModelConfig& model, const std::string& origin) const;
};

}  // namespace fsdpp
