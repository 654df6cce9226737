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
  c.device = s.get_string("device", c.device);
  c.backend = s.get_string("backend", c.backend);
  c.timeout_s = s.get_double("timeout_s", c.timeout_s, 0, 1e7);
  s.finish();
  if (c.device != "auto" && c.device != "cpu" && c.device != "cuda") {
    s.fail("device", "'" + c.device + "' is not one of auto, cpu, cuda");
  }
  const std::string backends = nccl_available() ? "auto, gloo, nccl" : "auto, gloo";
  if (c.backend != "auto" && c.backend != "gloo" && (c.backend != "nccl" || !nccl_available())) {
    s.fail("backend", "'" + c.backend + "' is not available in this build (" + backends + ")");
  }
  // Each backend moves data of one kind of device only.
  if (c.backend == "gloo" && c.device == "cuda") s.fail("backend", "gloo runs on the CPU, but device is 'cuda'");
  if (c.backend == "nccl" && c.device == "cpu") s.fail("backend", "nccl runs on GPUs, but device is 'cpu'");
  if (c.backend == "gloo") c.device = "cpu";
  if (c.backend == "nccl") c.device = "cuda";
  if (!(c.timeout_s > 0)) s.fail("timeout_s", "must be positive");
  return c;
}

}  // namespace fsdpp
