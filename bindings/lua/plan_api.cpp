// The declaring half of the policy API: wrap, mesh, precision, offload, lora, freeze, log and warn.
// Each wrap appends a UnitPlan, and lora sets the plan's LoraPlan, recording where in the
// script it was declared.
#include "bindings/lua/lua_internal.h"
#include "core/dtype.h"
#include "core/error.h"

#include "core/config_file.h"
#include "core/log.h"

#include <cmath>
#include <limits>
#include <string_view>

namespace fsdpp::lua {

namespace {

const std::vector<std::string> kWrapOptions = {"reshard_after_forward", "precision", "offload", "mesh",
                                               "activation_checkpoint"};

const std::vector<std::string> kPrecisionKeys = {"param", "reduce", "output", "compute"};

// The keys of a mesh, checked alike in mesh{...} and in a plain table given to wrap.
void check_mesh_keys(lua_State* L, int table) { check_keys(L, table, {"replicate", "shard"}, "mesh"); }

// A dtype a policy names.
at::ScalarType policy_dtype(const std::string& name) {
  try {
    return parse_dtype(name);
  } catch (const UserError& e) {
    throw ScriptError(std::string("precision: ") + e.what());
  }
}

// precision{compute = ...}: "fp8"; left out, products run in the param dtype.
ProductPrecision policy_compute(const std::string& name) {
  if (name == "fp8") return ProductPrecision::fp8;
  throw ScriptError("precision: compute = '" + name + "' is not \"fp8\" (left out, products run in the param dtype)");
}

// Where offload() and wrap{offload = ...} put master shards.
Offload policy_offload(const std::string& where) {
  if (where == "cpu") return Offload::cpu;
  if (where == "none") return Offload::none;
  throw ScriptError("offload: '" + where + "' is not one of \"cpu\", \"none\"");
}

// The integer on the stack's top as a mesh size: -1 (shard alone: every rank) or a rank count,
// checked before it narrows to an int.
int mesh_size(lua_State* L, const char* key, bool all_allowed) {
  const char* expected = all_allowed ? " must be an integer, -1 or \"auto\"" : " must be an integer";
  if (!lua_isinteger(L, -1)) throw ScriptError(std::string("mesh: ") + key + expected);
  const lua_Integer value = lua_tointeger(L, -1);
  if ((value < 1 && !(all_allowed && value == -1)) || value > std::numeric_limits<int>::max()) {
    throw ScriptError(std::string("mesh: ") + key + " must be " + (all_allowed ? "-1 or " : "") + "in [1, " +
                      std::to_string(std::numeric_limits<int>::max()) + "], got " + std::to_string(value));
  }
  return static_cast<int>(value);
}

int mesh_field(lua_State* L, int table, const char* key, int fallback) {
  raw_field(L, table, key);
  const int value = lua_isnil(L, -1) ? fallback : mesh_size(L, key, /*all_allowed=*/std::string_view(key) == "shard");
  lua_pop(L, 1);
  return value;
}

// A mesh's table {replicate = R, shard = S | -1 | "auto"} as {replicate, shard} for the world,
// replicate by default the world over shard. "auto" is the seed's rule: a model being trained
// shards over every rank; one only run forward (a reference or reward model) shards by size:
// < 10B parameters on 1 rank, < 80B on 8, larger on all.
MeshShape mesh_for_world(lua_State* L, int table) {
  PolicyRun& run = run_of(L);
  check_mesh_keys(L, table);
  const int world = run.context.world_size;
  int shard = -1;
  std::string auto_rule;  // why "auto" took the size it took
  raw_field(L, table, "shard");
  if (lua_type(L, -1) == LUA_TSTRING) {
    if (std::string(lua_tostring(L, -1)) != "auto") throw ScriptError("mesh: shard must be an integer, -1 or \"auto\"");
    const int64_t params = run.model->recursive_param_count();
    shard = run.context.training ? world
            : params < 10'000'000'000 ? 1
            : params < 80'000'000'000 ? std::min(8, world)
                                      : world;
    auto_rule = run.context.training ? std::string("every rank, as a trained model's")
                                     : concat("for a model of ", params, " parameters not trained");
  } else if (!lua_isnil(L, -1)) {
    shard = mesh_size(L, "shard", /*all_allowed=*/true);
  }
  lua_pop(L, 1);
  const int replicate = mesh_field(L, table, "replicate", shard > 0 && world % shard == 0 ? world / shard : 1);
  if (!auto_rule.empty() && int64_t{replicate} * shard != world) {
    throw ScriptError(concat("mesh: shard = \"auto\" takes ", shard, " ranks here (", auto_rule, "), and replicate ",
                             replicate, " × ", shard, " ≠ world ", world,
                             ": leave replicate out, or give shard a number"));
  }
  return {.replicate = replicate, .shard = shard};
}

// mesh{replicate = R, shard = S | -1 | "auto"} -> {replicate = R, shard = S} for the world.
int api_mesh(lua_State* L) {
  if (!lua_istable(L, 1)) throw ScriptError("mesh expects a table: mesh{replicate = ..., shard = ...}");
  const MeshShape mesh = mesh_for_world(L, 1);
  lua_newtable(L);
  lua_pushinteger(L, mesh.replicate);
  lua_setfield(L, -2, "replicate");
  lua_pushinteger(L, mesh.shard);
  lua_setfield(L, -2, "shard");
  return 1;
}

int api_precision(lua_State* L) {
  if (!lua_istable(L, 1)) {
    throw ScriptError("precision expects a table: precision{param = ..., reduce = ..., output = ..., compute = ...}");
  }
  check_keys(L, 1, kPrecisionKeys, "precision");
  lua_newtable(L);
  for (const auto& key : kPrecisionKeys) {
    raw_field(L, 1, key.c_str());
    if (!lua_isnil(L, -1)) {
      const std::string value = to_string_arg(L, -1, "precision");
      if (key == "compute") {
        policy_compute(value);
        lua_pushstring(L, value.c_str());
      } else {
        lua_pushstring(L, dtype_name(policy_dtype(value)).c_str());
      }
      lua_setfield(L, -3, key.c_str());
    }
    lua_pop(L, 1);
  }
  return 1;
}

int api_offload(lua_State* L) {
  const std::string where = to_string_arg(L, 1, "offload");
  policy_offload(where);
  lua_pushstring(L, where.c_str());
  return 1;
}

void read_wrap_options(lua_State* L, int table, UnitPlan& unit) {
  check_keys(L, table, kWrapOptions, "wrap");
  raw_field(L, table, "reshard_after_forward");
  if (lua_isinteger(L, -1)) {
    const lua_Integer k = lua_tointeger(L, -1);
    if (k < 1 || k > 1'000'000) throw ScriptError("wrap: reshard_after_forward = k needs 1 <= k <= 1000000");
    unit.reshard_after_forward = static_cast<int>(k);
  } else if (!lua_isnil(L, -1)) {
    if (!lua_isboolean(L, -1)) throw ScriptError("wrap: reshard_after_forward must be a boolean or a rank count");
    unit.reshard_after_forward = lua_toboolean(L, -1) ? kWholeShardGroup : 1;
  }
  lua_pop(L, 1);
  raw_field(L, table, "activation_checkpoint");
  if (!lua_isnil(L, -1)) {
    if (!lua_isboolean(L, -1)) throw ScriptError("wrap: activation_checkpoint must be a boolean");
    unit.activation_checkpoint = lua_toboolean(L, -1);
  }
  lua_pop(L, 1);
  raw_field(L, table, "offload");
  if (!lua_isnil(L, -1)) unit.offload = policy_offload(to_string_arg(L, -1, "wrap: offload"));
  lua_pop(L, 1);
  raw_field(L, table, "precision");
  if (!lua_isnil(L, -1)) {
    if (!lua_istable(L, -1)) throw ScriptError("wrap: precision must come from precision{...}");
    const int p = lua_gettop(L);
    check_keys(L, p, kPrecisionKeys, "wrap: precision");
    for (auto [key, field] : {std::pair{"param", &unit.param_dtype}, {"reduce", &unit.reduce_dtype},
                              {"output", &unit.output_dtype}}) {
      raw_field(L, p, key);
      if (!lua_isnil(L, -1)) *field = policy_dtype(to_string_arg(L, -1, "wrap: precision"));
      lua_pop(L, 1);
    }
    raw_field(L, p, "compute");
    if (!lua_isnil(L, -1)) unit.compute = policy_compute(to_string_arg(L, -1, "wrap: precision"));
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  raw_field(L, table, "mesh");
  if (!lua_isnil(L, -1)) {
    if (!lua_istable(L, -1)) throw ScriptError("wrap: mesh must come from mesh{...}");
    unit.mesh = mesh_for_world(L, lua_gettop(L));
  }
  lua_pop(L, 1);
}

// wrap(module | {module, ...}, options): one unit of the module(s) given.
// The paths of the module, or the list of modules, at stack `index`: the first argument of
// `call` (wrap, freeze), which must name at least one.
std::vector<std::string> module_arguments(lua_State* L, int index, const std::string& call) {
  PolicyRun& run = run_of(L);
  std::vector<std::string> paths;
  if (lua_isuserdata(L, index)) {
    paths.push_back(run.modules[static_cast<size_t>(module_index(L, index))].path);
  } else if (lua_istable(L, index)) {
    const auto n = static_cast<int>(lua_rawlen(L, index));
    for (int i = 1; i <= n; ++i) {
      lua_rawgeti(L, index, i);
      paths.push_back(run.modules[static_cast<size_t>(module_index(L, -1))].path);
      lua_pop(L, 1);
    }
    if (paths.empty()) throw ScriptError(call + ": the module list is empty");
  } else {
    throw ScriptError(call + " expects a module or a list of modules, got " + luaL_typename(L, index));
  }
  return paths;
}

int api_wrap(lua_State* L) {
  PolicyRun& run = run_of(L);
  UnitPlan unit;
  unit.origin = caller_location(L);
  unit.modules = module_arguments(L, 1, "wrap");
  if (!lua_isnoneornil(L, 2)) {
    if (!lua_istable(L, 2)) throw ScriptError("wrap: options must be a table");
    read_wrap_options(L, 2, unit);
  }
  claim_modules(unit, run.wrapped);
  run.plan.units.push_back(std::move(unit));
  return 0;
}

// The paths of the module handles in the list at `table`[key] (absent: none).
std::vector<std::string> module_list(lua_State* L, int table, const char* key, const std::string& what) {
  std::vector<std::string> paths;
  raw_field(L, table, key);
  if (!lua_isnil(L, -1)) {
    if (!lua_istable(L, -1)) throw ScriptError(what + " must be a list of modules (from find{...})");
    const int list = lua_gettop(L);
    const auto n = static_cast<int>(lua_rawlen(L, list));
    for (int i = 1; i <= n; ++i) {
      lua_rawgeti(L, list, i);
      paths.push_back(run_of(L).modules[static_cast<size_t>(module_index(L, -1))].path);
      lua_pop(L, 1);
    }
  }
  lua_pop(L, 1);
  return paths;
}

double number_field(lua_State* L, int table, const char* key, double fallback, double min, double max) {
  raw_field(L, table, key);
  double value = fallback;
  if (!lua_isnil(L, -1)) {
    if (lua_type(L, -1) != LUA_TNUMBER) throw ScriptError(std::string("lora: ") + key + " must be a number");
    value = lua_tonumber(L, -1);
  }
  lua_pop(L, 1);
  if (!(value >= min && value <= max)) {
    throw ScriptError(std::string("lora: ") + key + " must be in [" + lua_text(min) + ", " + lua_text(max) + "], got " +
                      lua_text(value));
  }
  return value;
}

// lora{targets = {module, ...}, rank = r, alpha = a, dropout = p, trainable = {module, ...}}:
// PEFT's LoRA on the target Linear modules; the base is frozen but for `trainable`.
int api_lora(lua_State* L) {
  PolicyRun& run = run_of(L);
  if (!lua_istable(L, 1)) throw ScriptError("lora expects a table: lora{targets = ..., rank = ..., alpha = ...}");
  check_keys(L, 1, {"targets", "rank", "alpha", "dropout", "trainable"}, "lora");
  if (run.plan.lora) throw ScriptError("lora: declared twice (first at " + run.plan.lora->origin + ")");
  LoraPlan lora{.origin = caller_location(L)};
  lora.targets = module_list(L, 1, "targets", "lora: targets");
  if (lora.targets.empty()) throw ScriptError("lora: no target modules: the adapters would have nothing to adapt");
  raw_field(L, 1, "rank");
  if (!lua_isinteger(L, -1) || lua_tointeger(L, -1) < 1 || lua_tointeger(L, -1) > 65536) {
    throw ScriptError("lora: rank must be an integer in [1, 65536]");
  }
  lora.rank = lua_tointeger(L, -1);
  lua_pop(L, 1);
  lora.alpha = number_field(L, 1, "alpha", 8.0, 1e-6, 1e6);  // PEFT's default
  lora.dropout = number_field(L, 1, "dropout", 0.0, 0.0, 0.99);
  lora.trainable = module_list(L, 1, "trainable", "lora: trainable");
  run.plan.lora = std::move(lora);
  return 0;
}

// freeze(module or {module, ...}): the modules' parameters do not train (a vision tower held
// as it was loaded); with lora{...} the base is frozen already, and lora's trainable says what
// of it trains.
int api_freeze(lua_State* L) {
  PolicyRun& run = run_of(L);
  FrozenModules frozen{.paths = module_arguments(L, 1, "freeze"), .origin = caller_location(L)};
  if (run.plan.frozen) throw ScriptError("freeze: declared twice (first at " + run.plan.frozen->origin + ")");
  run.plan.frozen = std::move(frozen);
  return 0;
}

// The arguments as Lua's tostring gives them, space-separated, cut at kMaxLineBytes (a
// __tostring that fails is a ScriptError, not a jump over this function's strings).
std::string joined_args(lua_State* L) {
  std::string text;
  size_t total = 0;
  const int n = lua_gettop(L);
  for (int i = 1; i <= n; ++i) {
    lua_getfield(L, LUA_REGISTRYINDEX, "fsdpp.tostring");
    lua_pushvalue(L, i);
    protected_call(L, 1, 1);
    size_t length = 0;
    const char* part = lua_tolstring(L, -1, &length);
    total += length + (i > 1 ? 1 : 0);
    if (text.size() < kMaxLineBytes) {
      text += (i > 1 ? " " : "") + (part ? one_line(std::string(part, std::min(length, kMaxLineBytes))) : "?");
    }
    lua_pop(L, 1);
  }
  return cut_line(std::move(text), total);
}

int api_log(lua_State* L) {
  PolicyRun& run = run_of(L);
  const std::string line = caller_location(L) + ": " + joined_args(L);
  run.logged_bytes += line.size();
  if (run.logged_bytes > run.log_cap) {
    pass_cap(L, concat("log: more than the ", run.log_cap, " bytes a policy may print (a log inside a loop?)"));
  }
  log_info(line);
  return 0;
}

int api_warn(lua_State* L) {
  add_warning(L, caller_location(L) + ": " + joined_args(L));
  return 0;
}

}  // namespace

void open_plan_api(lua_State* L) {
  const luaL_Reg functions[] = {{"wrap", guarded<api_wrap>},     {"mesh", guarded<api_mesh>},
                                {"precision", guarded<api_precision>}, {"offload", guarded<api_offload>},
                                {"log", guarded<api_log>},       {"warn", guarded<api_warn>},
                                {"lora", guarded<api_lora>},
                                {"freeze", guarded<api_freeze>},
                                {nullptr, nullptr}};
  lua_pushglobaltable(L);
  luaL_setfuncs(L, functions, 0);
  lua_pop(L, 1);
}

}  // namespace fsdpp::lua
