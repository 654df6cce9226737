// The [optimizer] section: AdamW's hyperparameters, range-checked where they enter.
#pragma once

namespace fsdpp {

class ConfigSection;

struct OptimizerConfig {
  // Where AdamW updates masters that live in host memory (offloaded units of a GPU run, every
  // unit of a CPU run): `overlapped` on a host thread, unit by unit in the order the next
  // forward gathers them, so that forward starts while later units still update; `in_step`
  // before the step returns. `automatic` overlaps on a GPU run, whose forward leaves the host's
  // cores free, and not on a CPU run, whose forward computes on them.
  enum class HostUpdate { automatic, overlapped, in_step };

  double lr = 3e-4;            // peak learning rate (the schedule scales it)
  double weight_decay = 0.0;   // decoupled decay for matrices; vectors never decay
  double beta1 = 0.9;          // first-moment decay
  double beta2 = 0.999;        // second-moment decay
  double eps = 1e-8;           // denominator guard
  HostUpdate host_update = HostUpdate::automatic;  // "auto", "overlapped" or "in_step"

  static OptimizerConfig from_section(ConfigSection& section);
};

}  // namespace fsdpp
