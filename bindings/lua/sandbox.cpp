// The policy sandbox: base, string, table and math only, a clock, a load that refuses
// bytecode, require confined to policies/lib, locked globals, an instruction budget and a
// memory cap. Errors carry file:line and a traceback.
#include "bindings/lua/lua_internal.h"
#include "core/config_file.h"

#include <chrono>
#include <fstream>
#include <sstream>

namespace fsdpp::lua {

namespace {

constexpr int kHookEvery = 1000;  // instructions between budget checks

void* capped_alloc(void* ud, void* ptr, size_t old_size, size_t new_size) {
  auto* run = static_cast<PolicyRun*>(ud);
  if (ptr == nullptr) old_size = 0;  // for new blocks Lua passes the object type here
  if (new_size == 0) {
    std::free(ptr);
    run->memory_used -= old_size;
    return nullptr;
  }
  if (new_size > old_size && run->memory_used + (new_size - old_size) > run->memory_cap) return nullptr;
  void* block = std::realloc(ptr, new_size);
  if (block != nullptr) run->memory_used = run->memory_used - old_size + new_size;
  return block;
}

void budget_hook(lua_State* L, lua_Debug*) {
  PolicyRun& run = run_of(L);
  run.instructions_left -= kHookEvery;
  if (run.instructions_left < 0) {
    // Inside a hook the running function is level 0, which luaL_error would skip.
    luaL_where(L, 0);
    lua_pushstring(L, "policy exceeded its instruction budget (an endless loop?)");
    lua_concat(L, 2);
    lua_error(L);
  }
}

int api_clock(lua_State* L) {
  static const auto start = std::chrono::steady_clock::now();
  lua_pushnumber(L, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return 1;
}

// load(text [, name]) for text chunks only, in the sandbox's globals.
int api_load(lua_State* L) {
  size_t size = 0;
  const char* text = lua_tolstring(L, 1, &size);
  if (text == nullptr) throw ScriptError("load: only source text can be loaded");
  const std::string name = lua_isstring(L, 2) ? lua_tostring(L, 2) : "=(load)";
  if (luaL_loadbufferx(L, text, size, name.c_str(), "t") != LUA_OK) {
    lua_pushnil(L);
    lua_insert(L, -2);
    return 2;
  }
  return 1;
}

// require("name"): policies/lib/name.lua, run once, its result cached.
int api_require(lua_State* L) {
  PolicyRun& run = run_of(L);
  const std::string name = to_string_arg(L, 1, "require");
  const bool plain = !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
  });
  if (!plain) throw ScriptError("require: '" + name + "' is not a module of policies/lib (names are letters, digits, _)");
  lua_getfield(L, LUA_REGISTRYINDEX, "fsdpp.loaded");
  if (lua_getfield(L, -1, name.c_str()) != LUA_TNIL) return 1;
  lua_pop(L, 1);
  const auto path = run.lib_dir / (name + ".lua");
  if (!std::filesystem::is_regular_file(path)) {
    throw ScriptError("require: no module '" + name + "' in " + run.lib_dir.string());
  }
  const std::string source = read_text(path);
  if (luaL_loadbufferx(L, source.data(), source.size(), chunk_name(path).c_str(), "t") != LUA_OK) {
    throw ScriptError(lua_tostring(L, -1));
  }
  protected_call(L, 0, 1);
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    lua_pushboolean(L, 1);
  }
  lua_pushvalue(L, -1);
  lua_setfield(L, -3, name.c_str());
  return 1;
}

int locked_newindex(lua_State* L) {
  return luaL_error(L, "assignment to undeclared global '%s' (use local)", luaL_tolstring(L, 2, nullptr));
}

int locked_index(lua_State* L) {
  return luaL_error(L, "undefined global '%s'", luaL_tolstring(L, 2, nullptr));
}

}  // namespace

PolicyRun& run_of(lua_State* L) { return **static_cast<PolicyRun**>(lua_getextraspace(L)); }

std::string to_string_arg(lua_State* L, int index, const char* what) {
  if (lua_type(L, index) != LUA_TSTRING) {
    throw ScriptError(std::string(what) + ": expected a string, got " + luaL_typename(L, index));
  }
  return lua_tostring(L, index);
}

void check_keys(lua_State* L, int table, const std::vector<std::string>& allowed, const char* what) {
  for (lua_pushnil(L); lua_next(L, table) != 0; lua_pop(L, 1)) {
    const std::string key = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "?";
    if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
      const std::string near = nearest_name(key, allowed);
      throw ScriptError(std::string(what) + ": unknown option '" + key + "'" +
                        (near.empty() ? "" : "; did you mean '" + near + "'?"));
    }
  }
}

int raw_field(lua_State* L, int table, const char* key) {
  table = lua_absindex(L, table);
  lua_pushstring(L, key);
  return lua_rawget(L, table);
}

void protected_call(lua_State* L, int nargs, int nresults) {
  if (lua_pcall(L, nargs, nresults, 0) == LUA_OK) return;
  const char* message = lua_tostring(L, -1);
  std::string text = message ? message : "(error object is not a string)";
  lua_pop(L, 1);
  throw ScriptError(text);
}

std::string caller_location(lua_State* L) {
  // The innermost frame of the policy itself, past helpers of policies/lib, so a unit
  // declared through a library call still points at the line that asked for it.
  std::string first;
  lua_Debug ar;
  for (int level = 1; lua_getstack(L, level, &ar) != 0; ++level) {
    if (lua_getinfo(L, "Sl", &ar) == 0 || ar.currentline <= 0) continue;
    std::string where = std::string(ar.short_src) + ":" + std::to_string(ar.currentline);
    if (first.empty()) first = where;
    if (std::string(ar.source).rfind("@policies/lib/", 0) != 0) return where;
  }
  return first.empty() ? "policy" : first;
}

std::string chunk_name(const std::filesystem::path& script) {
  // Shipped files are named from the repository root, so messages and golden plans read
  // the same on every machine.
  const auto relative = std::filesystem::relative(script, policy_dir());
  if (!relative.empty() && *relative.begin() != "..") return "@policies/" + relative.string();
  return "@" + script.string();
}

lua_State* open_sandbox(PolicyRun& run) {
  lua_State* L = lua_newstate(capped_alloc, &run);
  if (L == nullptr) return nullptr;
  *static_cast<PolicyRun**>(lua_getextraspace(L)) = &run;
  luaL_requiref(L, LUA_GNAME, luaopen_base, 1);
  luaL_requiref(L, LUA_STRLIBNAME, luaopen_string, 1);
  luaL_requiref(L, LUA_TABLIBNAME, luaopen_table, 1);
  luaL_requiref(L, LUA_MATHLIBNAME, luaopen_math, 1);
  lua_pop(L, 4);
  lua_pushglobaltable(L);
  for (const char* unsafe : {"dofile", "loadfile", "collectgarbage", "print"}) {
    lua_pushnil(L);
    lua_setfield(L, -2, unsafe);
  }
  lua_getfield(L, -1, "string");
  lua_pushnil(L);
  lua_setfield(L, -2, "dump");  // bytecode out is bytecode in
  // The bindings call these; registry copies stay right whatever a policy rebinds.
  lua_getfield(L, -1, "find");
  lua_setfield(L, LUA_REGISTRYINDEX, "fsdpp.string_find");
  lua_pop(L, 1);
  lua_getfield(L, -1, "tostring");
  lua_setfield(L, LUA_REGISTRYINDEX, "fsdpp.tostring");
  lua_pushcfunction(L, guarded<api_load>);
  lua_setfield(L, -2, "load");
  lua_pushcfunction(L, guarded<api_require>);
  lua_setfield(L, -2, "require");
  lua_newtable(L);
  lua_pushcfunction(L, api_clock);
  lua_setfield(L, -2, "clock");
  lua_setfield(L, -2, "os");
  lua_pop(L, 1);
  lua_newtable(L);
  lua_setfield(L, LUA_REGISTRYINDEX, "fsdpp.loaded");
  open_module_api(L);
  open_plan_api(L);
  lua_sethook(L, budget_hook, LUA_MASKCOUNT, kHookEvery);
  return L;
}

void lock_globals(lua_State* L) {
  lua_pushglobaltable(L);
  lua_newtable(L);
  lua_pushcfunction(L, locked_newindex);
  lua_setfield(L, -2, "__newindex");
  lua_pushcfunction(L, locked_index);
  lua_setfield(L, -2, "__index");
  lua_setmetatable(L, -2);
  lua_pop(L, 1);
}

int traceback_handler(lua_State* L) {
  const char* message = lua_tostring(L, 1);
  luaL_traceback(L, L, message ? message : "(error object is not a string)", 1);
  return 1;
}

}  // namespace fsdpp::lua
