// The [parallel] section: the device ranks compute on and the backend of their process
// groups, checked against what this build can run.
#pragma once

#include <string>

namespace fsdpp {

class ConfigSection;

struct ParallelConfig {
  std::string device = "auto";   // "auto" (this rank's GPU when there is one, else the CPU), "cpu" or "cuda"
  std::string backend = "auto";  // "auto" (nccl on a GPU, gloo on the CPU), "gloo" or "nccl"
  double timeout_s = 300;        // rendezvous and collective timeout

  static ParallelConfig from_section(ConfigSection& section);
};

// Whether this build can run NCCL process groups.
bool nccl_available();

}  // namespace fsdpp
