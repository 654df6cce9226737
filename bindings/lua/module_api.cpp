// Module handles for policies: a userdata holding an index into the run's module list, with
// read-only traversal methods (path, class, parameter counts and shapes, parent, children,
// find, get). Lua never touches tensors.
#include "bindings/lua/lua_internal.h"

#include "core/dtype.h"
#include "core/module_tree.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>

namespace fsdpp::lua {

namespace {

constexpr const char* kModuleType = "fsdpp.Module";

const ModuleEntry& entry(lua_State* L, int arg) { return run_of(L).modules[static_cast<size_t>(module_index(L, arg))]; }

// Does `path` lie strictly under `root` ("" is the model's root)?
bool strictly_under(const std::string& path, const std::string& root) {
  if (root.empty()) return !path.empty();
  return path.size() > root.size() && path.starts_with(root + ".");
}

int module_path(lua_State* L) {
  lua_pushstring(L, entry(L, 1).path.c_str());
  return 1;
}

int module_class_name(lua_State* L) {
  lua_pushstring(L, entry(L, 1).module->class_name().c_str());
  return 1;
}

int module_own_param_count(lua_State* L) {
  lua_pushinteger(L, entry(L, 1).module->own_param_count());
  return 1;
}

int module_param_count(lua_State* L) {
  lua_pushinteger(L, entry(L, 1).module->recursive_param_count());
  return 1;
}

// A parameter's dtype as the rest of the API names one (precision{...}, options' "dtype"):
// "float32", "bfloat16", ...; one no policy can name keeps ATen's name, in lower case.
std::string parameter_dtype(at::ScalarType type) {
  if (type == at::kFloat || type == at::kDouble || type == at::kBFloat16 || type == at::kHalf) return dtype_name(type);
  std::string name = c10::toString(type);
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  return name;
}

int module_parameters(lua_State* L) {
  const ModuleEntry& e = entry(L, 1);
  lua_newtable(L);
  int i = 0;
  for (const auto& item : e.module->named_parameters(/*recurse=*/false)) {
    lua_newtable(L);
    lua_pushstring(L, (e.path.empty() ? item.key() : e.path + "." + item.key()).c_str());
    lua_setfield(L, -2, "name");
    lua_newtable(L);
    int d = 0;
    for (int64_t size : item.value().sizes()) {
      lua_pushinteger(L, size);
      lua_rawseti(L, -2, ++d);
    }
    lua_setfield(L, -2, "shape");
    lua_pushstring(L, parameter_dtype(item.value().scalar_type()).c_str());
    lua_setfield(L, -2, "dtype");
    lua_pushinteger(L, item.value().numel());
    lua_setfield(L, -2, "numel");
    lua_rawseti(L, -2, ++i);
  }
  return 1;
}

int module_parent(lua_State* L) {
  const Module* parent = entry(L, 1).module->parent();
  if (parent == nullptr) {
    lua_pushnil(L);
  } else {
    push_module(L, run_of(L).index_of.at(parent));
  }
  return 1;
}

int module_children(lua_State* L) {
  lua_newtable(L);
  int i = 0;
  for (const auto& [name, child] : entry(L, 1).module->named_child_modules()) {
    push_module(L, run_of(L).index_of.at(child));
    lua_rawseti(L, -2, ++i);
  }
  return 1;
}

// find{class = "X", path = "lua pattern", where = function(m) ... end}: descendants matching
// every criterion given, in model order.
int module_find(lua_State* L) {
  PolicyRun& run = run_of(L);
  const std::string root = entry(L, 1).path;
  if (!lua_istable(L, 2)) throw ScriptError("find expects a table: find{class = ..., path = ..., where = ...}");
  check_keys(L, 2, {"class", "path", "where"}, "find");
  raw_field(L, 2, "class");
  const bool by_class = !lua_isnil(L, -1);
  const std::string cls = by_class ? to_string_arg(L, -1, "find: class") : "";
  raw_field(L, 2, "path");
  const bool by_path = !lua_isnil(L, -1);
  if (by_path) to_string_arg(L, -1, "find: path");
  const int pattern = lua_gettop(L);
  raw_field(L, 2, "where");
  const bool by_predicate = !lua_isnil(L, -1);
  if (by_predicate && !lua_isfunction(L, -1)) throw ScriptError("find: where must be a function");
  const int predicate = lua_gettop(L);
  if (by_class && !run.classes.count(cls) && run.warned_classes.insert(cls).second) {
    std::string have;
    for (const auto& c : run.classes) have += (have.empty() ? "" : ", ") + c;
    add_warning(L, caller_location(L) + ": the model has no class '" + cut_line(cls, cls.size()) + "' (it has: " +
                         have + ")");
  }
  lua_newtable(L);
  const int result = lua_gettop(L);
  int n = 0;
  for (size_t i = 0; i < run.modules.size(); ++i) {
    const ModuleEntry& m = run.modules[i];
    if (!strictly_under(m.path, root)) continue;
    if (by_class && m.module->class_name() != cls) continue;
    if (by_path) {
      // string.find(path, pattern) through Lua itself, so patterns mean what they do in Lua.
      lua_getfield(L, LUA_REGISTRYINDEX, "fsdpp.string_find");
      lua_pushstring(L, m.path.c_str());
      lua_pushvalue(L, pattern);
      protected_call(L, 2, 1);
      const bool hit = !lua_isnil(L, -1);
      lua_pop(L, 1);
      if (!hit) continue;
    }
    if (by_predicate) {
      lua_pushvalue(L, predicate);
      push_module(L, static_cast<int>(i));
      protected_call(L, 1, 1);
      const bool keep = lua_toboolean(L, -1);
      lua_pop(L, 1);
      if (!keep) continue;
    }
    push_module(L, static_cast<int>(i));
    lua_rawseti(L, result, ++n);
  }
  return 1;
}

// get("model.layers.0"): the module at a path relative to this one.
int module_get(lua_State* L) {
  PolicyRun& run = run_of(L);
  const std::string base = entry(L, 1).path;
  const std::string rel = to_string_arg(L, 2, "get: path");
  const std::string path = base.empty() ? rel : rel.empty() ? base : base + "." + rel;
  for (size_t i = 0; i < run.modules.size(); ++i) {
    if (run.modules[i].path == path) {
      push_module(L, static_cast<int>(i));
      return 1;
    }
  }
  throw ScriptError("get: no module at path '" + path + "'");
}

int module_tostring(lua_State* L) {
  const ModuleEntry& e = entry(L, 1);
  lua_pushstring(L, ("Module(" + module_label(e.path) + ": " + e.module->class_name() + ")").c_str());
  return 1;
}

}  // namespace

int module_index(lua_State* L, int arg) {
  auto* index = static_cast<int*>(luaL_testudata(L, arg, kModuleType));
  if (index == nullptr) {
    throw ScriptError(std::string("expected a module, got ") + luaL_typename(L, arg));
  }
  return *index;
}

void push_module(lua_State* L, int index) {
  // One userdata per module (cached in the registry), so handles compare equal with ==.
  lua_getfield(L, LUA_REGISTRYINDEX, "fsdpp.module_handles");
  if (lua_rawgeti(L, -1, index + 1) == LUA_TNIL) {
    lua_pop(L, 1);
    *static_cast<int*>(lua_newuserdatauv(L, sizeof(int), 0)) = index;
    luaL_setmetatable(L, kModuleType);
    lua_pushvalue(L, -1);
    lua_rawseti(L, -3, index + 1);
  }
  lua_remove(L, -2);
}

void open_module_api(lua_State* L) {
  lua_newtable(L);
  lua_setfield(L, LUA_REGISTRYINDEX, "fsdpp.module_handles");
  luaL_newmetatable(L, kModuleType);
  const luaL_Reg methods[] = {{"path", guarded<module_path>},
                              {"class_name", guarded<module_class_name>},
                              {"own_param_count", guarded<module_own_param_count>},
                              {"param_count", guarded<module_param_count>},
                              {"parameters", guarded<module_parameters>},
                              {"parent", guarded<module_parent>},
                              {"children", guarded<module_children>},
                              {"find", guarded<module_find>},
                              {"get", guarded<module_get>},
                              {nullptr, nullptr}};
  luaL_newlib(L, methods);
  lua_setfield(L, -2, "__index");
  lua_pushcfunction(L, guarded<module_tostring>);
  lua_setfield(L, -2, "__tostring");
  lua_pushliteral(L, "locked");
  lua_setfield(L, -2, "__metatable");
  lua_pop(L, 1);
}

}  // namespace fsdpp::lua
