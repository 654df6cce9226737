// The [optimizer] section: AdamW's hyperparameters, range-checked where they enter.
#pragma once

namespace fsdpp {

class ConfigSection;

struct OptimizerConfig {
  double lr = 3e-4;            // peak learning rate (the schedule scales it)
  double weight_decay = 0.0;   // decoupled decay for matrices; vectors never decay
  double beta1 = 0.9;          // first-moment decay
  double beta2 = 0.999;        // second-moment decay
  double eps = 1e-8;           // denominator guard

  static OptimizerConfig from_section(ConfigSection& section);
};

}  // namespace fsdpp
