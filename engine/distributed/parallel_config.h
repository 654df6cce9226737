// The [parallel] section: the device ranks compute on and the backend of their process
// groups, checked against what this build can run.
#pragma once

#include <string>

#include "core/device_choice.h"

namespace fsdpp {

class ConfigSection;

struct ParallelConfig {
  // "auto" (this rank's GPU when there is one, else the CPU), "cpu" or "cuda"; the key
  // backend ("auto": nccl on a GPU, gloo on the CPU; "gloo"; "nccl") settles it too, since
  // each backend moves data of one kind of device only.
  DeviceChoice device = DeviceChoice::automatic;
  // The setting that asks for a GPU, as messages name it ("run.toml:7: [parallel] backend =
  // \"nccl\""); empty while the device is "auto".
  std::string gpu_asked_by;
  double timeout_s = 300;  // rendezvous and collective timeout

  static ParallelConfig from_section(ConfigSection& section);
};

// Whether this build can run NCCL process groups.
bool nccl_available();

}  // namespace fsdpp
