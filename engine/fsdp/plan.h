// A wrap plan: what a policy declares, as plain data. Units name modules by dotted path and
// carry their options; validation resolves which parameters each unit owns (inner units
// first, the root last taking the rest) and reports per-rank memory, all without a process
// group, so `fsdpp plan --world 64` runs anywhere in seconds.
#pragma once

#include "core/module.h"

#include <string>
#include <vector>

namespace fsdpp {

struct MeshShape {
  int replicate = 1;
  int shard = -1;  // -1: world / replicate
};

struct UnitPlan {
  std::vector<std::string> modules;       // dotted paths; "" is the root
  bool reshard_after_forward = true;
  int reshard_to = 0;                     // reshard_after_forward = k: keep 1/k after forward, so
                                          // backward gathers over k ranks; 0: as the bool says
  std::string param_dtype;                // "" keeps the model's dtype
  std::string reduce_dtype;               // gradient reduction; "" is the masters' (float32, or float64)
  std::string output_dtype;               // "" leaves outputs as computed
  std::string offload = "none";           // "none" or "cpu"
  bool activation_checkpoint = false;
  MeshShape mesh;
  std::string origin;                     // where the policy declared it (file:line)
};

struct Plan {
  std::vector<UnitPlan> units;            // as declared; the root unit, if declared, among them
  std::vector<std::string> warnings;
};

// What one unit owns once the plan is resolved against a model.
struct ResolvedUnit {
  const UnitPlan* plan = nullptr;
  int replicate = 1, shard = 1;           // its mesh, resolved for the world
  std::string name;                       // modules joined by "+", "<root>" for the root
  struct Param {
    std::string name;                     // full dotted name (the first path reaching it)
    Module* module = nullptr;             // the module that registers it under `local`
    std::string local;
  };
  std::vector<Param> params;              // the parameters it owns
  int64_t numel = 0;                      // elements it owns
  int64_t padded_numel_per_rank = 0;      // Σ ceil(rows / shard) × row elements
  int64_t bytes_gathered = 0;             // its full parameters in its parameter dtype
};

struct ResolvedPlan {
  std::vector<ResolvedUnit> units;        // in application order: inner first, root last
  int64_t total_numel = 0;
  // Per rank, from the padded shards: fp32 master params, fp32 grads, AdamW's two moments.
  int64_t param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0;
  int64_t largest_gathered_bytes = 0;
};

// Checks `plan` against the model for `world` ranks and resolves ownership: unknown paths,
// a module in two units, tied parameters split across units, a mesh that does not fit or an
// option out of range are UserErrors naming paths and sizes. Units may use different meshes
// (a vision tower replicated beside a sharded language model, say). The root unit is added
// when the plan lacks one, on the first unit's mesh.
ResolvedPlan resolve_plan(Plan& plan, Module& root, int world, at::ScalarType model_dtype);

// The unit tree and per-rank memory as text, or as JSON.
std::string format_plan(const ResolvedPlan& plan, int world);
std::string plan_json(const ResolvedPlan& plan, int world);
// A declared plan as text and back, every field kept: how a policy evaluated in another
// process hands its plan over.
std::string serialize_plan(const Plan& plan);
Plan deserialize_plan(const std::string& text);

}  // namespace fsdpp
