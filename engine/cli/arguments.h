// The fsdpp command line, parsed once by CLI11 into typed options: which command runs, and
// every option it takes. Bad input is a UserError in one line naming the command and the
// option; --help yields the command's help text instead of a run.
#pragma once

#include "distributed/launcher.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fsdpp {

enum class Command { train, eval, plan, launch, export_checkpoint, probe };

struct CommandLine {
  Command command = Command::train;
  std::string help;  // not empty: print it and exit 0

  // train, eval and plan
  std::string config;                  // the TOML run file
  std::vector<std::string> overrides;  // --set section.key=value, in order
  bool verbose = false;                // debug lines, such as a policy error's Lua traceback
  // eval
  std::string tokens;       // --tokens: evaluate this file instead of data.train's held-out part
  std::string logits;       // --logits: also write the first windows' logits here
  int64_t max_windows = 0;  // --max-windows: at most this many rows (0: all)
  bool json = false;        // eval and plan: one JSON object on stdout
  // plan
  int world = 1;  // --world: the simulated world size
  // export
  std::string checkpoint, out;  // CHECKPOINT and OUT
  std::optional<at::ScalarType> dtype;  // --dtype: none keeps the dtype the run trained in
  double max_shard_mb = 2048;   // --max-shard-mb: the largest safetensors shard
  bool merge_lora = false;      // --merge-lora: a LoRA run's adapters merged into its weights
  bool adapter_only = false;    // --adapter: a LoRA run's adapters alone, as a PEFT adapter
  // launch
  LaunchOptions launch;
};

// argv as main receives it; argv[1] names the command.
CommandLine parse_command_line(int argc, char** argv);

}  // namespace fsdpp
