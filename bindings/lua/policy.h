// Running a wrap policy: a sandboxed Lua 5.4 script that reads the model tree and declares
// FSDP units. The rest of the engine sees only this header: a Plan comes out, and every Lua
// failure is a one-line UserError carrying the script's file:line (the traceback goes to the
// debug log). The script runs in a child process, so nothing it does, hanging inside a C
// routine or crashing, reaches the engine.
#pragma once

#include "bindings/lua/policy_config.h"
#include "fsdp/plan.h"
#include "models/causal_lm.h"

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace fsdpp {

struct PolicyContext {
  int world_size = 1;
  int rank = 0;
  bool training = true;
  std::vector<GivenOption> options;  // [policy.options]: read through options{...}, each one checked
};

struct PolicyLimits {
  int64_t instructions = 50'000'000;  // Lua VM instructions before the script is stopped
  size_t memory_bytes = 64u << 20;    // heap the script may hold
  size_t engine_bytes = 1u << 30;     // what the engine may allocate for the script's calls besides
  size_t log_bytes = 1u << 20;        // what log() may print in all (a log in an endless loop fills disks)
  std::chrono::milliseconds deadline{20'000};  // wall clock for the whole evaluation, C code included
};

// The script for `config.name`: a path when it names an existing .lua file, else
// <policy dir>/<name>.lua; "" means the model_type's own policy.
std::filesystem::path find_policy(const PolicyConfig& config, const std::string& model_type);
// The shipped policies' folder: $FSDPP_POLICY_DIR, else the one this build came from.
std::filesystem::path policy_dir();

Plan run_policy(const std::filesystem::path& script, CausalLM& model, const PolicyContext& context,
                const PolicyLimits& limits = {});
// The plan a run's [policy] gives `model` at (world, rank): one that trains it, or one that
// only runs it forward (ctx.training false: a frozen reference model).
Plan run_configured_policy(const PolicyConfig& config, CausalLM& model, int world, int rank, bool training);
// resolve_plan of the plan `config`'s policy made. Its sizes often come from the run file's
// [policy.options]: a plan it refuses also names those given, with where each was set.
ResolvedPlan resolve_policy_plan(const Plan& plan, Module& root, int world, at::ScalarType model_dtype,
                                 const PolicyConfig& config);

}  // namespace fsdpp
