// Keeping the CPU's matrix kernels to ones that run. oneDNN picks AMX tile kernels for bf16
// products wherever the CPU advertises AMX, and on hosts that advertise it without enabling
// it (a hypervisor that leaves the tile state off) the first tile instruction faults with
// SIGILL, whichever thread runs it. Probing single instructions does not catch this; running
// the real kernel does. oneDNN reads its ISA cap once, so the cap goes into the environment
// and the process starts again with it before any of its kernels has run.
#pragma once

#include <optional>
#include <string>

namespace fsdpp {

// The environment variable oneDNN caps its instruction set with, and the cap below AMX.
inline constexpr const char* kOnednnIsaVariable = "ONEDNN_MAX_CPU_ISA";
inline constexpr const char* kOnednnIsaBelowAmx = "AVX512_CORE_BF16";

// Whether /proc/cpuinfo lists an AMX feature (amx_tile, amx_bf16).
bool cpu_advertises_amx();
// Runs one small bf16 product in a forked child: true when it finished with the right
// answer, false when the child died, hung or answered wrongly.
bool bf16_products_run();
// The cap this process needs: ONEDNN_MAX_CPU_ISA's value when the CPU advertises AMX and a
// bf16 product fails (or FSDPP_CPU_PROBE=fail forces a fault, for tests), nothing otherwise
// or when the environment already sets a cap. Costs a read of /proc/cpuinfo where nothing
// advertises AMX.
std::optional<std::string> needed_onednn_cap();
// Settles the cap in this process, once per process tree: when one is needed, logs one
// warning and sets it, returning true. It holds if no oneDNN kernel has run yet (oneDNN reads
// the cap on first use), as in a Python process importing the fsdpp package. A process it
// has checked marks the environment, so launched ranks inherit the answer.
bool cap_cpu_kernels();
// The same before any kernel runs, and when a cap was set, re-executes `argv` with it (this
// function then does not return), so that nothing can have read the environment before.
void settle_cpu_kernels(char** argv);

}  // namespace fsdpp
