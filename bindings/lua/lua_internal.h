// Shared by the binding units only (never included outside bindings/lua): the per-run state
// a Lua state points at, and the guard that turns C++ exceptions into Lua errors once no
// C++ object is alive in the guard, so no C++ exception ever crosses a Lua frame.
#pragma once

#include "bindings/lua/policy.h"
#include "core/error.h"
#include "core/module_tree.h"

#include <lua.hpp>

#include <cstdio>
#include <map>
#include <new>
#include <set>
#include <stdexcept>

namespace fsdpp::lua {

struct PolicyRun {
  CausalLM* model = nullptr;
  PolicyContext context;
  std::vector<ModuleEntry> modules;      // pre-order; a handle is an index into it
  std::map<const Module*, int> index_of;
  std::set<std::string> classes;         // every class name the model has
  std::set<std::string> warned_classes;  // missing classes already reported
  size_t logged_bytes = 0, log_cap = 0;  // what log() has printed, and may print in all
  Plan plan;
  std::map<std::string, std::string> wrapped;  // module path -> origin of the unit wrapping it
  std::filesystem::path lib_dir;         // where require() looks
  std::vector<std::string> requiring;    // the modules require() is running, outermost first
  size_t memory_used = 0, memory_cap = 0;
  int64_t instructions_left = 0;
  std::string budget_error;              // set once the budget is spent: "file:line: ..."
  std::string cap_error;                 // set once a cap (warnings, log bytes) is passed: "file:line: ..."
  char budget_line[LUA_IDSIZE + 24] = "";  // "file:line" the script ran at the last budget check
  std::string option_error;              // a [policy.options] value refused: "run.toml:line: ..."
};

PolicyRun& run_of(lua_State* L);
// A policy's warning, kept in the plan and logged as it is made: a script that fails after
// it may fail for the reason it gives. Past kMaxWarnings it is a cap passed (pass_cap):
// warnings live in the engine's memory, outside the Lua heap's cap.
inline constexpr size_t kMaxWarnings = 1000;
void add_warning(lua_State* L, const std::string& text);
// Throws the ScriptError for a cap (`what`) passed at the policy's calling line, and keeps the
// first such error: like the spent budget, no pcall may swallow it (sticky_error), and the
// run fails on it even where the script went on.
[[noreturn]] void pass_cap(lua_State* L, const std::string& what);
// The error no pcall or xpcall handler may catch once set: the spent budget, a passed cap;
// "" while there is none.
const std::string& sticky_error(const PolicyRun& run);

// A fresh Lua state for `run` with the sandbox's libraries, budget and memory cap, and the
// engine's module and plan functions (sandbox.cpp); nullptr when Lua cannot allocate it.
lua_State* open_sandbox(PolicyRun& run);
// Makes the globals and library tables read-only for every chunk loaded from here on.
void lock_globals(lua_State* L);
// Replaces the table on top of the stack, and every table inside it, by read-only views
// (`name` in messages: "ctx.config.x is read-only"), so that what the engine hands a policy
// reads the same to every chunk that reads it.
void make_read_only_tree(lua_State* L, const std::string& name);

// Whether `message` opens with a script's "file:line: ", as Lua's own errors do.
bool starts_with_location(const std::string& message);

// Errors a binding raises; message only, the guard adds the script's file:line.
struct ScriptError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <int (*Body)(lua_State*)>
int guarded(lua_State* L) {
  char message[kMaxMessageBytes + 64];  // no std::string: lua_error's longjmp skips destructors
  try {
    return Body(L);
  } catch (const std::bad_alloc&) {
    // The evaluation's process caps what the engine allocates for a script (PolicyLimits).
    std::snprintf(message, sizeof message, "%s",
                  "out of memory: the engine's share for this policy is spent (a call inside a loop?)");
  } catch (const std::exception& e) {
    std::snprintf(message, sizeof message, "%s", message_line(e.what()).c_str());
  }
  // A Lua error come back through a callback the binding ran names its own line already.
  if (starts_with_location(message)) {
    lua_pushstring(L, message);
  } else {
    luaL_where(L, 1);
    lua_pushstring(L, message);
    lua_concat(L, 2);
  }
  return lua_error(L);
}

// Argument helpers that throw ScriptError instead of raising Lua errors mid-function.
std::string to_string_arg(lua_State* L, int index, const char* what);
// Checks that a table has only `allowed` string keys (naming the nearest for a typo).
void check_keys(lua_State* L, int table, const std::vector<std::string>& allowed, const char* what);
// A table key as messages name it: 'name', [1], or "of type table".
std::string key_text(lua_State* L, int index);
// Pushes table[key] without metamethods (a policy's table may carry any) and returns its type.
int raw_field(lua_State* L, int table, const char* key);
// Calls the function below its `nargs` arguments in protected mode. A Lua error (a bad
// pattern, a failing predicate, the instruction budget) comes back as a ScriptError, so it
// unwinds the binding's C++ frames instead of jumping over them.
void protected_call(lua_State* L, int nargs, int nresults);
// lua_pcall's message handler: the error as one line with its file:line (also for error
// objects that are not strings); the traceback goes to the debug log.
int message_handler(lua_State* L);
// "file:line" of the policy code calling the current C function.
std::string caller_location(lua_State* L);
// The chunk name a script is loaded under: "@policies/..." for shipped files.
std::string chunk_name(const std::filesystem::path& script);
// Loads a script file as the stand-alone interpreter reads one (without a UTF-8 byte-order
// mark, a first line opening with '#' blanked), text only, under its chunk_name; lua_load's
// status, with the chunk or the error message pushed.
int load_script(lua_State* L, const std::filesystem::path& script);

void push_policy_value(lua_State* L, const PolicyValue& value);
// A value as a policy would write it: true, 8, 0.5, "cpu".
std::string lua_text(const PolicyValue& value);
void push_module(lua_State* L, int index);
int module_index(lua_State* L, int arg);  // throws unless arg is a module handle
void open_module_api(lua_State* L);
void open_plan_api(lua_State* L);
void open_options_api(lua_State* L);
// After the script: a UserError for the first [policy.options] entry no options{...} declared,
// naming its run-file line and the nearest declared option; `policy` names the script.
void check_given_options(const PolicyRun& run, const std::string& policy);

}  // namespace fsdpp::lua
