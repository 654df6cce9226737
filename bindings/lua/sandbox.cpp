// The policy sandbox: an allow-list of the base library with string, table and math, a
// clock, a load that refuses bytecode, require confined to policies/lib; read-only globals
// and library tables behind protected metatables; an instruction budget that no pcall can
// swallow once spent, no finalizers, and a memory cap. (The wall-clock deadline is the
// caller's: policy.cpp runs the whole evaluation in a child process.) Every error is one
// line with the script's file:line (lua_internal.cpp's message handler); the traceback goes
// to the debug log.
#include "bindings/lua/lua_internal.h"

#include <chrono>
#include <set>

namespace fsdpp::lua {

namespace {

constexpr int kHookEvery = 1000;  // instructions between budget checks

// What a policy may use of the base library; the rest (rawset, collectgarbage, dofile,
// loadfile, print, ...) is not there. pcall, xpcall, setmetatable, load and require are the
// sandbox's own.
const std::set<std::string> kBaseAllowed = {"assert", "error",  "getmetatable", "ipairs",   "next",
                                            "pairs",  "rawequal", "rawget",     "rawlen",   "select",
                                            "tonumber", "tostring", "type",     "_VERSION", "_G",
                                            "string", "table",  "math"};

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

void budget_hook(lua_State* L, lua_Debug* ar) {
  PolicyRun& run = run_of(L);
  // Kept for the memory cap's message: the allocator cannot read the stack safely (Lua may be
  // moving it), and a failed allocation raises no error a handler sees. It is the line running
  // at most kHookEvery instructions before; a char array, for no allocation fails here.
  if (lua_getinfo(L, "Sl", ar) != 0 && ar->currentline > 0) {
    std::snprintf(run.budget_line, sizeof run.budget_line, "%s:%d", ar->short_src, ar->currentline);
  }
  run.instructions_left -= kHookEvery;
  if (run.instructions_left < 0) {
    // Inside a hook the running function is level 0, which luaL_error would skip.
    if (run.budget_error.empty()) {
      luaL_where(L, 0);
      try {  // a C++ exception must not unwind through the Lua VM's frames above this hook
        run.budget_error = std::string(lua_tostring(L, -1)) + "policy exceeded its instruction budget (an endless loop?)";
      } catch (const std::bad_alloc&) {
        run.budget_error.clear();
      }
      lua_pop(L, 1);
    }
    // No C++ object lives here: lua_error's longjmp skips destructors.
    lua_pushstring(L, run.budget_error.empty() ? "policy exceeded its instruction budget" : run.budget_error.c_str());
    lua_error(L);
  }
}

int api_clock(lua_State* L) {
  static const auto start = std::chrono::steady_clock::now();
  lua_pushnumber(L, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return 1;
}

// load(text [, name [, mode [, env]]]) as Lua's, for text chunks only: a mode that allows text
// loads text, one that does not ("b") refuses it as Lua does; env, given (nil too), is the
// chunk's _ENV, else the sandbox's globals.
int api_load(lua_State* L) {
  size_t size = 0;
  const char* text = lua_tolstring(L, 1, &size);
  if (text == nullptr) throw ScriptError("load: only source text can be loaded");
  std::string name = lua_isstring(L, 2) ? lua_tostring(L, 2) : "=(load)";
  // '@' marks a file: the message handler and caller_location tell the policy's files by it.
  if (name.starts_with("@")) name[0] = '=';
  const std::string mode = lua_isnoneornil(L, 3) ? "bt" : to_string_arg(L, 3, "load: mode");
  const char* text_only = mode.find('t') != std::string::npos ? "t" : mode.c_str();  // never bytecode
  if (luaL_loadbufferx(L, text, size, name.c_str(), text_only) != LUA_OK) {
    lua_pushnil(L);
    lua_insert(L, -2);
    return 2;
  }
  if (!lua_isnone(L, 4)) {
    lua_pushvalue(L, 4);
    if (lua_setupvalue(L, -2, 1) == nullptr) lua_pop(L, 1);
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
  // A module that requires itself, through others or not, would recurse until the C stack ends.
  if (std::find(run.requiring.begin(), run.requiring.end(), name) != run.requiring.end()) {
    std::string cycle;
    for (auto it = std::find(run.requiring.begin(), run.requiring.end(), name); it != run.requiring.end(); ++it) {
      cycle += *it + " -> ";
    }
    throw ScriptError("require: '" + name + "' requires itself (" + cycle + name + ")");
  }
  if (load_script(L, path) != LUA_OK) {
    throw ScriptError(lua_tostring(L, -1));
  }
  run.requiring.push_back(name);
  struct Done {
    std::vector<std::string>& requiring;
    ~Done() { requiring.pop_back(); }
  } done{run.requiring};
  protected_call(L, 0, 1);
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    lua_pushboolean(L, 1);
  }
  lua_pushvalue(L, -1);
  lua_setfield(L, -3, name.c_str());
  return 1;
}

// pcall and xpcall that catch a policy's errors but not the end of its budget or a passed
// cap (sticky_error): once set, the error goes on up, so `while true do pcall(loop) end` stops too.
int finish_pcall(lua_State* L, int status, int first_result) {
  if (status != LUA_OK && !sticky_error(run_of(L)).empty()) {
    lua_pushstring(L, sticky_error(run_of(L)).c_str());  // not what a handler made of it
    return lua_error(L);
  }
  lua_pushboolean(L, status == LUA_OK);
  lua_insert(L, first_result);
  return lua_gettop(L) - first_result + 1;
}

int api_pcall(lua_State* L) {
  luaL_checkany(L, 1);
  return finish_pcall(L, lua_pcall(L, lua_gettop(L) - 1, LUA_MULTRET, 0), 1);
}

// The policy's xpcall handler (upvalue 1), run only while no sticky error is set: Lua runs a
// handler for the budget's error inside the hook, with hooks off, where no budget would stop it.
int xpcall_handler(lua_State* L) {
  if (const std::string& sticky = sticky_error(run_of(L)); !sticky.empty()) {
    lua_pushstring(L, sticky.c_str());
    return 1;
  }
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_insert(L, 1);
  lua_call(L, lua_gettop(L) - 1, 1);
  return 1;
}

int api_xpcall(lua_State* L) {
  luaL_checktype(L, 2, LUA_TFUNCTION);
  lua_pushvalue(L, 2);
  lua_pushcclosure(L, xpcall_handler, 1);
  lua_pushvalue(L, 1);  // [f, handler, args..., wrapped handler, f] -> [wrapped handler, f, args...]
  lua_replace(L, 2);
  lua_replace(L, 1);
  return finish_pcall(L, lua_pcall(L, lua_gettop(L) - 2, LUA_MULTRET, 1), 2);
}

// setmetatable without finalizers: a __gc would run when the collector chooses, where the
// budget does not reach (Lua runs finalizers with hooks off), or when the state closes.
int api_setmetatable(lua_State* L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  const int type = lua_type(L, 2);
  luaL_argexpected(L, type == LUA_TNIL || type == LUA_TTABLE, 2, "nil or table");
  if (type == LUA_TTABLE && raw_field(L, 2, "__gc") != LUA_TNIL) {
    return luaL_error(L, "setmetatable: __gc finalizers are not allowed in a policy");
  }
  lua_settop(L, 2);
  if (luaL_getmetafield(L, 1, "__metatable") != LUA_TNIL) return luaL_error(L, "cannot change a protected metatable");
  lua_setmetatable(L, 1);
  return 1;
}

// The read-only view of a table: reads reach it, writes fail, pairs walks it, and its
// metatable is protected. Upvalues: 1 the table, 2 its name in messages, 3 whether it is the
// globals (whose missing names are errors to read too).
int read_only_index(lua_State* L) {
  lua_pushvalue(L, 2);
  if (lua_rawget(L, lua_upvalueindex(1)) == LUA_TNIL && lua_toboolean(L, lua_upvalueindex(3))) {
    return luaL_error(L, "undefined global '%s'", luaL_tolstring(L, 2, nullptr));
  }
  return 1;
}

int read_only_newindex(lua_State* L) {
  const char* key = luaL_tolstring(L, 2, nullptr);
  if (lua_toboolean(L, lua_upvalueindex(3))) {
    lua_pushvalue(L, 2);
    return lua_rawget(L, lua_upvalueindex(1)) == LUA_TNIL
               ? luaL_error(L, "assignment to undeclared global '%s' (use local)", key)
               : luaL_error(L, "assignment to global '%s': globals are read-only (use local)", key);
  }
  return luaL_error(L, "%s.%s is read-only", lua_tostring(L, lua_upvalueindex(2)), key);
}

// pairs() over a view walks the real table, held as the iterator's upvalue: handed out as the
// iteration's state (as next's pairs does), the table itself would be the policy's to write.
int read_only_next(lua_State* L) {
  lua_settop(L, 2);  // the state (nil), the key
  if (lua_next(L, lua_upvalueindex(1)) != 0) return 2;
  lua_pushnil(L);
  return 1;
}

int read_only_len(lua_State* L) {
  lua_pushinteger(L, static_cast<lua_Integer>(lua_rawlen(L, lua_upvalueindex(1))));
  return 1;
}

int read_only_pairs(lua_State* L) {
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_pushcclosure(L, read_only_next, 1);
  lua_pushnil(L);
  lua_pushnil(L);
  return 3;
}

// Replaces the table on top of the stack by its read-only view; `globals` makes reads of
// missing names an error too.
void push_read_only(lua_State* L, const char* name, bool globals) {
  const int table = lua_gettop(L);
  lua_newtable(L);  // the view
  lua_newtable(L);  // its metatable
  for (auto [event, function] : {std::pair<const char*, lua_CFunction>{"__index", read_only_index},
                                 {"__newindex", read_only_newindex}, {"__pairs", read_only_pairs},
                                 {"__len", read_only_len}}) {
    lua_pushvalue(L, table);
    lua_pushstring(L, name);
    lua_pushboolean(L, globals);
    lua_pushcclosure(L, function, 3);
    lua_setfield(L, -2, event);
  }
  lua_pushliteral(L, "locked");
  lua_setfield(L, -2, "__metatable");
  lua_setmetatable(L, -2);
  lua_replace(L, table);
}

}  // namespace

lua_State* open_sandbox(PolicyRun& run) {
  lua_State* L = lua_newstate(capped_alloc, &run);
  if (L == nullptr) return nullptr;
  *static_cast<PolicyRun**>(lua_getextraspace(L)) = &run;
  luaL_requiref(L, LUA_GNAME, luaopen_base, 1);
  luaL_requiref(L, LUA_STRLIBNAME, luaopen_string, 1);
  luaL_requiref(L, LUA_TABLIBNAME, luaopen_table, 1);
  luaL_requiref(L, LUA_MATHLIBNAME, luaopen_math, 1);
  // Lua seeds math.random per process; a policy runs once per rank and must plan alike on
  // each, so every run draws the same numbers unless the policy seeds them itself.
  lua_getfield(L, -1, "randomseed");
  lua_pushinteger(L, 0);
  lua_call(L, 1, 0);
  lua_pop(L, 4);
  lua_pushglobaltable(L);
  std::vector<std::string> dropped;
  for (lua_pushnil(L); lua_next(L, -2) != 0; lua_pop(L, 1)) {
    if (lua_type(L, -2) == LUA_TSTRING && !kBaseAllowed.count(lua_tostring(L, -2))) dropped.push_back(lua_tostring(L, -2));
  }
  for (const auto& name : dropped) {
    lua_pushnil(L);
    lua_setfield(L, -2, name.c_str());
  }
  for (auto [name, function] : {std::pair<const char*, lua_CFunction>{"pcall", api_pcall}, {"xpcall", api_xpcall},
                                {"setmetatable", api_setmetatable}}) {
    lua_pushcfunction(L, function);
    lua_setfield(L, -2, name);
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
  open_options_api(L);
  lua_sethook(L, budget_hook, LUA_MASKCOUNT, kHookEvery);
  return L;
}

void make_read_only_tree(lua_State* L, const std::string& name) {
  const int table = lua_gettop(L);
  // Existing fields only are rewritten, which a traversal allows.
  for (lua_pushnil(L); lua_next(L, table) != 0; lua_pop(L, 1)) {
    if (lua_type(L, -1) != LUA_TTABLE) continue;
    const std::string inner = name + "." + (lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "[]");
    lua_pushvalue(L, -2);  // the key
    lua_pushvalue(L, -2);  // the inner table
    make_read_only_tree(L, inner);
    lua_rawset(L, table);
  }
  push_read_only(L, name.c_str(), false);
}

void lock_globals(lua_State* L) {
  lua_pushglobaltable(L);
  const int globals = lua_gettop(L);
  for (const char* library : {"string", "table", "math", "os"}) {
    lua_getfield(L, globals, library);
    push_read_only(L, library, false);
    lua_setfield(L, globals, library);
  }
  // Strings index the real string table through their metatable, which a policy can no
  // longer reach: getmetatable("") answers "locked".
  lua_pushliteral(L, "");
  lua_getmetatable(L, -1);
  lua_pushliteral(L, "locked");
  lua_setfield(L, -2, "__metatable");
  lua_pop(L, 2);
  // Every chunk loaded from here on (the policy, require, load) sees the read-only view.
  lua_pushvalue(L, globals);
  push_read_only(L, "_G", true);
  lua_pushvalue(L, -1);
  lua_setfield(L, globals, "_G");
  lua_rawseti(L, LUA_REGISTRYINDEX, LUA_RIDX_GLOBALS);
  lua_pop(L, 1);
}

}  // namespace fsdpp::lua
