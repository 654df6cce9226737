// Where a rank computes, as a run asks for it ([parallel] device): a name parsed once into
// this value, which core/device.h resolves to a device of this process.
#pragma once

namespace fsdpp {

enum class DeviceChoice {
  automatic,  // "auto": this rank's GPU when the process sees any, else the CPU
  cpu,        // "cpu"
  cuda,       // "cuda": the GPU numbered by the local rank, or the only one the process sees
              // when it is the node's only rank
};

}  // namespace fsdpp
