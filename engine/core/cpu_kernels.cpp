// The probe: a forked child runs the product the engine's bf16 layers run (at::linear), so a
// fault kills only the child.
#include "core/cpu_kernels.h"

#include "core/isolated.h"
#include "core/log.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <unistd.h>

namespace fsdpp {

namespace {

// Set in the environment of a process whose CPU kernels were settled; its children skip
// the probe.
constexpr const char* kCheckedVariable = "FSDPP_CPU_KERNELS_CHECKED";

bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string(v) == value;
}

}  // namespace

bool cpu_advertises_amx() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream flags(line.substr(line.find(':') + 1));
    for (std::string flag; flags >> flag;) {
      if (flag == "amx_tile" || flag == "amx_bf16") return true;
    }
    return false;  // every core lists the same flags
  }
  return false;
}

bool bf16_products_run() {
  const auto result = run_isolated(
      [] {
        at::set_num_threads(1);
        const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
        const at::Tensor x = at::ones({64, 128}, bf16), w = at::ones({96, 128}, bf16);  // [N, K], [M, K]
        return at::linear(x, w).to(at::kFloat).allclose(at::full({64, 96}, 128.0)) ? "right" : "wrong";
      },
      std::chrono::seconds(60));
  // Anything but a right answer (a fault, a hang, no child at all) keeps to the slower kernels.
  return result.end == IsolatedResult::End::finished && result.output == "right";
}

std::optional<std::string> needed_onednn_cap() {
  if (std::getenv(kOnednnIsaVariable) != nullptr) return std::nullopt;  // the user's cap stands
  // FSDPP_CPU_PROBE=fail stands for a fault, so tests reach the fallback on any CPU.
  const bool fault = env_is("FSDPP_CPU_PROBE", "fail") || (cpu_advertises_amx() && !bf16_products_run());
  return fault ? std::optional<std::string>(kOnednnIsaBelowAmx) : std::nullopt;
}

bool cap_cpu_kernels() {
  if (std::getenv(kCheckedVariable) != nullptr) return false;
  const auto cap = needed_onednn_cap();
  ::setenv(kCheckedVariable, "1", 1);
  if (!cap) return false;
  log_warn("bf16 matrix kernels fault on this CPU (it advertises AMX without enabling it); oneDNN is capped at ",
           *cap, " (", kOnednnIsaVariable, ")");
  ::setenv(kOnednnIsaVariable, cap->c_str(), 1);
  return true;
}

void settle_cpu_kernels(char** argv) {
  if (!cap_cpu_kernels()) return;
  ::execv("/proc/self/exe", argv);
  // Not re-executed: the cap may still take effect, since oneDNN reads it on first use.
}

}  // namespace fsdpp
