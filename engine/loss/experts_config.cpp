// Parsing the [experts] section.
#include "loss/experts_config.h"

#include "core/config_file.h"
#include "core/error.h"
#include "models/model_config.h"

namespace fsdpp {

ExpertsConfig ExpertsConfig::from_section(ConfigSection& s) {
  ExpertsConfig c;
  c.bias_update_rate = s.get_double("bias_update_rate", c.bias_update_rate, 0, 1);
  s.finish();
  return c;
}

void ExpertsConfig::check_model(const ModelConfig& model, const std::string& origin) const {
  const bool biased = model.moe && model.moe->routing == MoeConfig::Routing::grouped_sigmoid;
  if (bias_update_rate > 0 && !biased) {
    throw UserError(origin + ": [experts] bias_update_rate moves routing biases (e_score_correction_bias), " +
                    "which model_type '" + model.model_type + "' does not have (deepseek_v3 has)");
  }
}

}  // namespace fsdpp
