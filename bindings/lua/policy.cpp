// Loading and running a policy script, and the [policy] section.
#include "bindings/lua/lua_internal.h"

#include "core/error.h"
#include "core/isolated.h"
#include "core/log.h"
#include "fsdp/plan_text.h"
#include "policy_dir.h"

#include <algorithm>
#include <set>

namespace fsdpp {

namespace {

using namespace lua;

// A list of the class names of the model's modules for which `chosen` holds, each once.
template <class Chosen>
void push_classes(lua_State* L, const PolicyRun& run, Chosen chosen) {
  lua_newtable(L);
  std::vector<std::string> classes;
  for (const auto& e : run.modules) {
    const std::string& cls = e.module->class_name();
    if (chosen(*e.module) && std::find(classes.begin(), classes.end(), cls) == classes.end()) {
      classes.push_back(cls);
      lua_pushstring(L, cls.c_str());
      lua_rawseti(L, -2, static_cast<lua_Integer>(classes.size()));
    }
  }
}

// The `ctx` global: world, rank, training, the model handle, its config, no_split_modules,
// expert_modules (the classes holding a MoE layer's routed experts) and float32_modules
// (those transformers keeps in float32).
void push_context(lua_State* L, const PolicyRun& run) {
  const ModelConfig& c = run.model->config();
  lua_newtable(L);
  lua_pushinteger(L, run.context.world_size);
  lua_setfield(L, -2, "world_size");
  lua_pushinteger(L, run.context.rank);
  lua_setfield(L, -2, "rank");
  lua_pushboolean(L, run.context.training);
  lua_setfield(L, -2, "training");
  push_module(L, 0);
  lua_setfield(L, -2, "model");
  lua_newtable(L);
  lua_pushstring(L, c.model_type.c_str());
  lua_setfield(L, -2, "model_type");
  for (auto [key, value] : {std::pair{"vocab_size", c.vocab_size}, {"hidden_size", c.hidden_size},
                            {"intermediate_size", c.intermediate_size}, {"num_hidden_layers", c.num_hidden_layers},
                            {"num_attention_heads", c.num_attention_heads},
                            {"num_key_value_heads", c.num_key_value_heads}, {"head_dim", c.head_dim}}) {
    lua_pushinteger(L, value);
    lua_setfield(L, -2, key);
  }
  if (c.moe) {
    lua_pushinteger(L, c.moe->num_experts);
    lua_setfield(L, -2, "num_experts");
    lua_pushinteger(L, c.moe->num_experts_per_tok);
    lua_setfield(L, -2, "num_experts_per_tok");
  }
  lua_pushboolean(L, c.tie_word_embeddings);
  lua_setfield(L, -2, "tie_word_embeddings");
  lua_pushinteger(L, run.model->recursive_param_count());
  lua_setfield(L, -2, "num_parameters");
  lua_setfield(L, -2, "config");
  lua_newtable(L);
  int i = 0;
  for (const auto& cls : run.model->no_split_modules()) {
    lua_pushstring(L, cls.c_str());
    lua_rawseti(L, -2, ++i);
  }
  lua_setfield(L, -2, "no_split_modules");
  push_classes(L, run, [](const Module& m) { return m.routed_experts(); });
  lua_setfield(L, -2, "expert_modules");
  push_classes(L, run, [](const Module& m) { return m.keeps_float32(); });
  lua_setfield(L, -2, "float32_modules");
  push_classes(L, run, [](const Module& m) { return m.is_container(); });
  lua_setfield(L, -2, "container_modules");
}

}  // namespace

std::filesystem::path policy_dir() {
  if (const char* dir = std::getenv("FSDPP_POLICY_DIR"); dir != nullptr && *dir != '\0') return dir;
  return FSDPP_SOURCE_POLICY_DIR;
}

std::filesystem::path find_policy(const PolicyConfig& config, const std::string& model_type) {
  const std::string name = config.name.empty() ? model_type : config.name;
  const std::string where = config.name_where.empty() ? "" : config.name_where + ": ";
  if (name.ends_with(".lua") || name.find('/') != std::string::npos) {
    if (!std::filesystem::exists(name)) {
      const std::string relative = std::filesystem::path(name).is_relative()
          ? " (relative paths resolve against the working directory " + std::filesystem::current_path().string() + ")"
          : "";
      throw UserError(where + "[policy] name: no policy file " + name + relative);
    }
    if (!std::filesystem::is_regular_file(name)) throw UserError(where + "[policy] name: " + name + " is not a file");
    return name;
  }
  if (std::error_code error; !std::filesystem::is_directory(policy_dir(), error)) {
    const char* from_env = std::getenv("FSDPP_POLICY_DIR");
    throw UserError(where + "[policy] name: no shipped policy '" + name + "': the policy directory " +
                    policy_dir().string() + (from_env && *from_env ? " (FSDPP_POLICY_DIR)" : "") + " is no directory");
  }
  const auto path = policy_dir() / (name + ".lua");
  if (!std::filesystem::exists(path)) {
    std::set<std::string> names;
    for (const auto& f : std::filesystem::directory_iterator(policy_dir())) {
      if (f.path().extension() == ".lua") names.insert(f.path().stem().string());
    }
    std::string shipped;
    for (const auto& n : names) shipped += (shipped.empty() ? "" : ", ") + n;
    throw UserError(where + "[policy] name: no shipped policy '" + name + "' in " + policy_dir().string() +
                    " (shipped: " + shipped + ")");
  }
  return path;
}

namespace {

// "; [policy.options] given: shard_size = 5 (--set policy.options.shard_size=5)": what the run
// file gave the policy, so that a refusal a value caused names where it came from; of those
// `message` names where it is given (a policy's error names the option it refuses); "" if none.
std::string given_options_text(const std::vector<GivenOption>& options, const std::string* message = nullptr) {
  std::string given;
  for (const auto& option : options) {
    if (message != nullptr && message->find(option.name) == std::string::npos) continue;
    given += (given.empty() ? "" : ", ") + option.name + " = " + lua::lua_text(option.value) +
             (option.where.empty() ? "" : " (" + option.where + ")");
  }
  return given.empty() ? "" : "; [policy.options] given: " + given;
}

// The evaluation itself, in whichever process calls it.
Plan evaluate_policy(const std::filesystem::path& script, CausalLM& model, const PolicyContext& context,
                     const PolicyLimits& limits) {
  PolicyRun run;
  run.model = &model;
  run.context = context;
  run.modules = named_modules(model);
  for (size_t i = 0; i < run.modules.size(); ++i) {
    run.index_of[run.modules[i].module] = static_cast<int>(i);
    run.classes.insert(run.modules[i].module->class_name());
  }
  run.lib_dir = policy_dir() / "lib";
  run.memory_cap = limits.memory_bytes;
  run.instructions_left = limits.instructions;
  run.log_cap = limits.log_bytes;

  lua_State* L = open_sandbox(run);
  if (L == nullptr) throw UserError(script.string() + ": cannot create a Lua state");
  std::unique_ptr<lua_State, void (*)(lua_State*)> close(L, lua_close);
  push_context(L, run);
  make_read_only_tree(L, "ctx");
  lua_setglobal(L, "ctx");
  lock_globals(L);
  lua_pushcfunction(L, message_handler);
  const int handler = lua_gettop(L);
  int status = load_script(L, script);
  if (status == LUA_OK) status = lua_pcall(L, 0, 0, handler);
  if (status != LUA_OK) {
    run.memory_cap = SIZE_MAX;  // room to report the failure
    // Lua raises the memory error where no handler runs: the line is the budget's last check.
    const std::string memory_where = run.budget_line[0] != '\0' ? run.budget_line : script.string();
    std::string message = status == LUA_ERRMEM
        ? memory_where + ": policy exceeded its memory cap of " + std::to_string(limits.memory_bytes >> 20) + " MiB"
        : lua_isstring(L, -1) ? std::string(lua_tostring(L, -1), lua_rawlen(L, -1)) : "policy failed";
    // A chunk refused before it ran (bytecode) names no line: the file it is, then.
    if (status != LUA_ERRMEM && !starts_with_location(message)) message = script.string() + ": " + message;
    if (!run.option_error.empty()) throw UserError(run.option_error);
    throw UserError("policy error: " + message + given_options_text(run.context.options, &message));
  }
  // A refused [policy.options] value is the run's error even where a pcall let the policy go on.
  if (!run.option_error.empty()) throw UserError(run.option_error);
  // So is a cap passed where a script caught its error in a way no pcall of ours saw.
  if (!run.cap_error.empty()) throw UserError("policy error: " + run.cap_error);
  check_given_options(run, chunk_name(script).substr(1));
  return std::move(run.plan);
}

}  // namespace

Plan run_policy(const std::filesystem::path& script, CausalLM& model, const PolicyContext& context,
                const PolicyLimits& limits) {
  const auto result = run_isolated(
      [&] { return serialize_plan(evaluate_policy(script, model, context, limits)); }, limits.deadline,
      limits.memory_bytes + limits.engine_bytes);
  const std::string where = "policy error: " + script.string() + ": ";
  switch (result.end) {
    case IsolatedResult::End::finished: break;
    case IsolatedResult::End::failed: throw UserError(result.output);
    case IsolatedResult::End::timed_out:
      throw UserError(where + concat("still running after ", limits.deadline.count() / 1000.0,
                                     " s, its deadline (a pattern match or loop that does not end?)"));
    case IsolatedResult::End::died:
      throw UserError(where + "its evaluation ended without a plan" +
                      (result.signal ? " (signal " + std::to_string(result.signal) + ")" : std::string()));
  }
  Plan plan = deserialize_plan(result.output);  // its warnings logged as the script made them
  if (plan.units.empty()) {
    throw UserError(script.string() + ": the policy wrapped nothing: no wrap{...} call declared a unit" +
                    (plan.warnings.empty() ? "" : " (its warnings above may say why)"));
  }
  return plan;
}

Plan run_configured_policy(const PolicyConfig& config, CausalLM& model, int world, int rank, bool training) {
  return run_policy(find_policy(config, model.config().model_type), model,
                    {.world_size = world, .rank = rank, .training = training, .options = config.options});
}

ResolvedPlan resolve_policy_plan(const Plan& plan, Module& root, int world, at::ScalarType model_dtype,
                                 const PolicyConfig& config) {
  try {
    return resolve_plan(plan, root, world, model_dtype);
  } catch (const UserError& e) {
    if (config.options.empty()) throw;
    throw UserError(std::string(e.what()) + given_options_text(config.options));
  }
}

}  // namespace fsdpp
