// The binding units' shared helpers: reading arguments without raising Lua errors, calling
// Lua from C++ so its errors come back as ScriptErrors, and naming the policy's file:line.
#include "bindings/lua/lua_internal.h"

#include "core/config_file.h"
#include "core/log.h"
#include "core/mapped_file.h"

#include <algorithm>
#include <cstring>

namespace fsdpp::lua {

namespace {

// The first frame with a line: where a non-string error object was raised.
std::string error_location(lua_State* L) {
  lua_Debug ar;
  for (int level = 1; lua_getstack(L, level, &ar) != 0; ++level) {
    if (lua_getinfo(L, "Sl", &ar) != 0 && ar.currentline > 0) {
      return std::string(ar.short_src) + ":" + std::to_string(ar.currentline) + ": ";
    }
  }
  return "";
}

// "file:line: " of the policy file that ran the chunk `load` made where an error was raised
// ("" when it was raised in a file): such a chunk's name, "(load)" or whatever the script gave
// it ("=fake.lua:99"), names no line of the policy. (api_load keeps '@', the mark of a file,
// out of chunk names.)
std::string loaded_chunk_caller(lua_State* L) {
  lua_Debug ar;
  bool in_loaded_chunk = false;
  for (int level = 1; lua_getstack(L, level, &ar) != 0; ++level) {
    if (lua_getinfo(L, "Sl", &ar) == 0 || ar.currentline <= 0) continue;
    if (ar.source[0] != '@') {
      in_loaded_chunk = true;
    } else {
      return in_loaded_chunk ? std::string(ar.short_src) + ":" + std::to_string(ar.currentline) + ": " : "";
    }
  }
  return "";
}

}  // namespace

PolicyRun& run_of(lua_State* L) { return **static_cast<PolicyRun**>(lua_getextraspace(L)); }

void add_warning(lua_State* L, const std::string& text) {
  PolicyRun& run = run_of(L);
  if (run.plan.warnings.size() >= kMaxWarnings) {
    pass_cap(L, concat("more than ", kMaxWarnings, " warnings (a warn or find inside a loop?)"));
  }
  std::string line = message_line(text);  // the script's text may hold line breaks and terminal codes
  log_warn(line);
  run.plan.warnings.push_back(std::move(line));
}

void pass_cap(lua_State* L, const std::string& what) {
  PolicyRun& run = run_of(L);
  std::string message = caller_location(L) + ": " + what;
  if (run.cap_error.empty()) run.cap_error = message;
  throw ScriptError(std::move(message));
}

const std::string& sticky_error(const PolicyRun& run) {
  return run.budget_error.empty() ? run.cap_error : run.budget_error;
}

void push_policy_value(lua_State* L, const PolicyValue& value) {
  std::visit([L](const auto& v) {
    using T = std::decay_t<decltype(v)>;
    if constexpr (std::is_same_v<T, bool>) lua_pushboolean(L, v);
    else if constexpr (std::is_same_v<T, int64_t>) lua_pushinteger(L, v);
    else if constexpr (std::is_same_v<T, double>) lua_pushnumber(L, v);
    else lua_pushlstring(L, v.data(), v.size());
  }, value);
}

std::string to_string_arg(lua_State* L, int index, const char* what) {
  if (lua_type(L, index) != LUA_TSTRING) {
    throw ScriptError(std::string(what) + ": expected a string, got " + luaL_typename(L, index));
  }
  size_t length = 0;
  const char* text = lua_tolstring(L, index, &length);
  // A Lua string may hold NUL bytes where a C string would end: refused, not cut short.
  if (std::memchr(text, '\0', length) != nullptr) throw ScriptError(std::string(what) + ": holds a NUL byte");
  return std::string(text, length);
}

std::string key_text(lua_State* L, int index) {
  switch (lua_type(L, index)) {
    case LUA_TSTRING:
      return "'" + std::string(lua_tostring(L, index)) + "'";
    case LUA_TNUMBER: {
      lua_pushvalue(L, index);  // a copy: lua_tostring on the key itself would confuse lua_next
      std::string text = "[" + std::string(lua_tostring(L, -1)) + "]";
      lua_pop(L, 1);
      return text;
    }
    default:
      return std::string("of type ") + luaL_typename(L, index);
  }
}

void check_keys(lua_State* L, int table, const std::vector<std::string>& allowed, const char* what) {
  for (lua_pushnil(L); lua_next(L, table) != 0; lua_pop(L, 1)) {
    const bool named = lua_type(L, -2) == LUA_TSTRING;
    if (named && std::find(allowed.begin(), allowed.end(), lua_tostring(L, -2)) != allowed.end()) continue;
    const std::string near = named ? nearest_name(lua_tostring(L, -2), allowed) : "";
    throw ScriptError(std::string(what) + ": unknown option " + key_text(L, -2) +
                      (near.empty() ? "" : "; did you mean '" + near + "'?"));
  }
}

int raw_field(lua_State* L, int table, const char* key) {
  table = lua_absindex(L, table);
  lua_pushstring(L, key);
  return lua_rawget(L, table);
}

void protected_call(lua_State* L, int nargs, int nresults) {
  const int function = lua_gettop(L) - nargs;
  lua_pushcfunction(L, message_handler);
  lua_insert(L, function);
  const int status = lua_pcall(L, nargs, nresults, function);
  lua_remove(L, function);
  if (status == LUA_OK) return;
  std::string text = lua_tostring(L, -1);
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

int load_script(lua_State* L, const std::filesystem::path& script) {
  std::string text = read_text_file(script);
  if (text.starts_with("\xEF\xBB\xBF")) text.erase(0, 3);
  // The '#' line's newline stays, so that errors name the file's own line numbers.
  if (text.starts_with("#")) text.erase(0, std::min(text.find('\n'), text.size()));
  return luaL_loadbufferx(L, text.data(), text.size(), chunk_name(script).c_str(), "t");
}

bool starts_with_location(const std::string& message) {
  const size_t end = message.find(": ");
  if (end == std::string::npos || end == 0) return false;
  const size_t colon = message.rfind(':', end - 1);
  if (colon == std::string::npos || colon == 0 || colon + 1 == end) return false;
  return std::all_of(message.begin() + static_cast<std::ptrdiff_t>(colon) + 1,
                     message.begin() + static_cast<std::ptrdiff_t>(end), [](char c) { return c >= '0' && c <= '9'; });
}

namespace {

// message_handler's line, built in C++ frames that have ended before it makes a Lua call that
// may raise (its traceback, out of memory), whose longjmp would skip their destructors; copied
// into `out` (`room` bytes), its length returned.
size_t handled_message(lua_State* L, char* out, size_t room) {
  std::string message;
  if (lua_type(L, 1) == LUA_TSTRING || lua_type(L, 1) == LUA_TNUMBER) {
    size_t length = 0;
    const char* text = lua_tolstring(L, 1, &length);
    message.assign(text, length);  // whole: a NUL in it is written out with the rest
    // error(x, 0), a number, or a level past the script carry no position: the innermost
    // line that has one is where the policy failed.
    if (!starts_with_location(message)) message = error_location(L) + message;
  } else {
    message = error_location(L) + "error raised with a " + luaL_typename(L, 1) + " value (error messages are strings)";
  }
  // An error come back through a binding's protected call was given the prefix there already.
  if (const std::string caller = loaded_chunk_caller(L); !message.starts_with(caller)) message = caller + message;
  // Every line of the message (a UserError writes its newlines out), cut as a log line is,
  // before the traceback copies it into the Lua heap, where a message near the heap's cap
  // would be reported as the script running out of memory.
  const size_t total = message.size();
  message = cut_line(std::move(message), total);
  const size_t length = std::min(message.size(), room);
  std::memcpy(out, message.data(), length);
  return length;
}

}  // namespace

int message_handler(lua_State* L) {
  char message[kMaxLineBytes + 64];  // cut_line's most, and its note of the cut
  const size_t length = handled_message(L, message, sizeof message - 1);
  message[length] = '\0';
  luaL_traceback(L, L, message, 1);
  log_line(LogLevel::debug, lua_tostring(L, -1));
  lua_pushlstring(L, message, length);
  return 1;
}

}  // namespace fsdpp::lua
