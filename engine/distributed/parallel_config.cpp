// Parsing the [parallel] section.
#include "distributed/parallel_config.h"

#include "core/config_file.h"

namespace fsdpp {

bool nccl_available() {
#ifdef USE_C10D_NCCL
  return true;
#else
  return false;
#endif
}

ParallelConfig ParallelConfig::from_section(ConfigSection& s) {
  ParallelConfig c;
  c.device = s.get_choice("device", c.device,
                          {{"auto", DeviceChoice::automatic}, {"cpu", DeviceChoice::cpu}, {"cuda", DeviceChoice::cuda}});
  // The backend follows the device, and a forced one settles it: gloo the CPU, nccl a GPU.
  const std::string backend = s.get_string("backend", "auto");
  c.timeout_s = s.get_double("timeout_s", c.timeout_s, 1, 1e7);
  s.finish();
  const std::string backends = nccl_available() ? "auto, gloo, nccl" : "auto, gloo";
  if (backend != "auto" && backend != "gloo" && (backend != "nccl" || !nccl_available())) {
    s.fail("backend", "'" + backend + "' is not available in this build (" + backends + ")");
  }
  if (backend == "gloo" && c.device == DeviceChoice::cuda) s.fail("backend", "gloo runs on the CPU, but device is 'cuda'");
  if (backend == "nccl" && c.device == DeviceChoice::cpu) s.fail("backend", "nccl runs on GPUs, but device is 'cpu'");
  if (backend == "gloo") c.device = DeviceChoice::cpu;
  if (c.device == DeviceChoice::cuda) c.gpu_asked_by = s.where("device") + ": [parallel] device = \"cuda\"";
  if (backend == "nccl") {
    c.device = DeviceChoice::cuda;
    c.gpu_asked_by = s.where("backend") + ": [parallel] backend = \"nccl\"";
  }
  if (!(c.timeout_s > 0)) s.fail("timeout_s", "must be positive");
  return c;
}

}  // namespace fsdpp
