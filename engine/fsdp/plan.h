// A wrap plan: what a policy declares, as plain data. Units name modules by dotted path and
// carry their options; validation resolves which parameters each unit owns (inner units
// first, the root last taking the rest) and reports per-rank memory, all without a process
// group, so `fsdpp plan --world 64` runs anywhere in seconds.
#pragma once

#include "core/module.h"
#include "distributed/mesh_shape.h"
#include "models/lora_plan.h"

#include <c10/core/ScalarType.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdpp {

// Where a unit's master shards live while it computes on a device.
enum class Offload { none, cpu };

// FSDP2's reshard_after_forward, held as the number of ranks a unit's backward gather spans:
// 1 keeps the gathered parameters after forward (false), k keeps 1/k of them on each rank (an
// integer k), and kWholeShardGroup frees them all, so backward gathers over the unit's whole
// shard group again (true).
inline constexpr int kWholeShardGroup = 0;

// How a unit's Linear layers multiply: in the dtype its parameters are gathered in, or in
// float8 (e4m3) with one scale per row of each operand, on GPUs with FP8 matrix units
// (models/fp8_product.h). Lua spells it precision{compute = "fp8"}.
enum class ProductPrecision { param, fp8 };

struct UnitPlan {
  std::vector<std::string> modules;                 // dotted paths; "" is the root
  int reshard_after_forward = kWholeShardGroup;     // ranks a backward gather spans (see above)
  std::optional<at::ScalarType> param_dtype;        // gather and compute in; none: the model's
  std::optional<at::ScalarType> reduce_dtype;       // gradient reduction; none: the masters'
  std::optional<at::ScalarType> output_dtype;       // cast outputs to; none: as computed
  ProductPrecision compute = ProductPrecision::param;  // its Linear layers' products
  Offload offload = Offload::none;
  bool activation_checkpoint = false;
  MeshShape mesh;
  std::string origin;                               // where the policy declared it (file:line)
};

// An option the policy declared (options{...} in Lua) and the value it took.
struct PolicyOption {
  std::string name;
  std::string accepts;                    // what values it takes: "true or false", "an integer >= 1 or \"auto\""
  std::string value;                      // in force, as Lua would write it; "" when unset
  bool given = false;                     // set by [policy.options], not the default
  std::string doc;
  std::string origin;                     // where the policy declared it (file:line)
};

// Modules whose parameters do not train (a policy's freeze{...}): each is then held in its
// unit's compute dtype, with no gradient or optimizer state, as a LoRA run's base is.
struct FrozenModules {
  std::vector<std::string> paths;         // dotted module paths; every parameter under each
  std::string origin;                     // where the policy declared it (file:line)
};

struct Plan {
  std::vector<UnitPlan> units;            // as declared; the root unit, if declared, among them
  std::optional<LoraPlan> lora;
  std::optional<FrozenModules> frozen;
  std::vector<PolicyOption> options;      // declared, by name
  std::vector<std::string> warnings;
};

// One unit of a plan resolved against a model and a world: every option in force and what
// the unit owns.
struct ResolvedUnit {
  UnitPlan declared;                      // as the policy declared it (the implicit root: as added)
  MeshShape mesh;                         // resolved for the world
  int reshard_after_forward = kWholeShardGroup;  // as declared, with k = shard read as kWholeShardGroup
  at::ScalarType compute_dtype = at::kFloat;  // gathered and computed in: declared, or the model's
  at::ScalarType reduce_dtype = at::kFloat;  // declared, or the masters' dtype
  std::string name;                       // modules joined by "+", "<root>" for the root
  struct Param {
    std::string name;                     // full dotted name (the first path reaching it)
    Module* module = nullptr;             // the module that registers it under `local`
    std::string local;
    // Frozen, moved by nothing, and computed in a dtype narrower than the masters' (a LoRA
    // base in bf16): its shard is held in compute_dtype alone, with no master.
    bool constant = false;
  };
  std::vector<Param> params;              // the parameters it owns
  int64_t numel = 0;                      // elements it owns
  int64_t padded_numel_per_rank = 0;      // Σ ceil(rows / shard) × row elements
  int64_t bytes_gathered = 0;             // its full parameters in its parameter dtype
  int64_t expert_numel = 0;               // of numel, in routed experts (Module::routed_experts)
  int64_t expert_numel_per_rank = 0;      // of padded_numel_per_rank, in routed experts
  int64_t expert_bytes_per_rank = 0;      // the routed experts' shards, as param_bytes counts them
  int64_t expert_bytes_gathered = 0;      // the routed experts' full parameters, as bytes_gathered counts them
  int64_t trainable_numel_per_rank = 0;   // of padded_numel_per_rank, in parameters that train
};

struct ResolvedPlan {
  std::vector<ResolvedUnit> units;        // in application order: inner first, root last; none of no parameters
  std::optional<LoraPlan> lora;           // as declared
  std::optional<FrozenModules> frozen;    // as declared
  std::vector<PolicyOption> options;      // as declared
  int64_t total_numel = 0;
  int64_t trainable_numel = 0;            // of total_numel, the parameters that train
  // Per rank, from the padded shards: master params (fp32, fp64 for an fp64 model; constant
  // ones in their compute dtype), grads and AdamW's two moments of the parameters that train,
  // in the masters' dtype.
  int64_t param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0;
  int64_t constant_param_bytes = 0;       // of param_bytes, the constant parameters' shards
  int64_t largest_gathered_bytes = 0;
  int64_t expert_param_bytes = 0;         // of param_bytes, the routed experts' master shards
  int64_t host_param_bytes = 0;           // of param_bytes, the shards of units offloaded to host memory
};

// Checks `plan` against the model for `world` ranks and resolves ownership: unknown paths,
// a module in two units, tied parameters split across units, a mesh that does not fit or an
// option out of range are UserErrors naming paths and sizes. Units may use different meshes
// (a vision tower replicated beside a sharded language model, say). The root unit is added
// when the plan lacks one, on the first unit's mesh.
ResolvedPlan resolve_plan(const Plan& plan, Module& root, int world, at::ScalarType model_dtype);

// Stops the parameters under `plan`'s frozen modules from training (requires_grad false), so
// that resolve_plan then holds them in their compute dtype with no gradient or optimizer
// state. UserError where a path is not a module of `root`, or the plan has LoRA adapters too.
void freeze_modules(const Plan& plan, Module& root);

// Refuses `unit` where it lists a module twice, a module and one that holds it, or a module
// that a unit in `wrapped` (path -> that unit's origin) holds already; then adds its modules
// there. A policy's wrap calls it as it goes (a wrap in an endless loop is stopped at once),
// resolve_plan over the whole plan.
void claim_modules(const UnitPlan& unit, std::map<std::string, std::string>& wrapped);

}  // namespace fsdpp
