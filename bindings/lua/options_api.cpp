// options{...}: a policy declares the [policy.options] it reads, each with the values it
// accepts, a default and a doc line, and gets back the values in force. A value the run file
// gives is checked here, so a wrong one is blamed on the run file's line, not the script's;
// after the script has run, check_given_options refuses any option no declaration named.
//
//   local opt = options{
//     shard_size = {-1, "integer", "auto", min = 1, default = -1, doc = "ranks per shard group"},
//     offload = {"cpu", "none", default = "none", doc = "where master shards live"},
//   }
//
// The list part names what a value may be: "integer", "number", "boolean", "string", "dtype"
// (a name parse_dtype reads), or a literal value; min and max bound the numbers.
#include "bindings/lua/lua_internal.h"

#include "core/config_file.h"
#include "core/dtype.h"
#include "core/error.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <map>
#include <optional>
#include <tuple>
#include <variant>

namespace fsdpp::lua {

namespace {

// What an option may be beside its literal values, by the names a declaration lists.
enum class OptionKind { integer, number, boolean, string, dtype };
const std::vector<std::string> kKindNames = {"integer", "number", "boolean", "string", "dtype"};  // by OptionKind

struct OptionSpec {
  std::vector<std::variant<OptionKind, PolicyValue>> listed;  // kinds and literal values, as declared
  std::vector<OptionKind> kinds;         // of listed, the kinds
  std::vector<PolicyValue> literals;     // of listed, the values accepted as they are
  std::optional<double> min, max;        // bound "integer" and "number"
  std::optional<PolicyValue> fallback;   // the default
  std::string doc;
};

// The fewest digits that read back as `value`, in fixed or exponent form, whichever is shorter
// ("10", "0.5", "1e-06").
std::string shortest(double value) {
  char text[32];
  const auto end = std::to_chars(text, text + sizeof text, value).ptr;
  return std::string(text, end);
}

}  // namespace

std::string lua_text(const PolicyValue& value) {
  return std::visit([](const auto& v) -> std::string {
    using T = std::decay_t<decltype(v)>;
    if constexpr (std::is_same_v<T, bool>) return v ? "true" : "false";
    else if constexpr (std::is_same_v<T, int64_t>) return std::to_string(v);
    else if constexpr (std::is_same_v<T, double>) {
      if (std::isnan(v)) return "nan";  // the sign of a NaN is noise ("-nan")
      const std::string shown = shortest(v);  // with a point, so that 2.0 is not shown as the integer 2
      return shown.find_first_of(".eni") == std::string::npos ? shown + ".0" : shown;
    } else return "\"" + v + "\"";
  }, value);
}

namespace {

// An integer option's bound as an integer where it is one within int64 (the cast of any
// other would be undefined).
std::string bound_text(double bound, bool integer) {
  const bool whole = bound == std::floor(bound) && std::fabs(bound) < 9.2e18;
  return integer && whole ? std::to_string(static_cast<int64_t>(bound)) : shortest(bound);
}

// "an integer in [1, 65536]", "a number >= 0", ...
std::string numeric_text(const OptionSpec& spec, bool integer) {
  std::string text = integer ? "an integer" : "a number";
  if (spec.min && spec.max) return text + " in [" + bound_text(*spec.min, integer) + ", " + bound_text(*spec.max, integer) + "]";
  if (spec.min) return text + " >= " + bound_text(*spec.min, integer);
  if (spec.max) return text + " <= " + bound_text(*spec.max, integer);
  return text;
}

std::optional<OptionKind> kind_named(const std::string& name) {
  const auto it = std::find(kKindNames.begin(), kKindNames.end(), name);
  if (it == kKindNames.end()) return std::nullopt;
  return static_cast<OptionKind>(it - kKindNames.begin());
}

// The kind a name that is none meant: a misspelling of one, or another language's name for
// it ("int", "bool", "float", "str"); "" for none.
std::string kind_meant(const std::string& name) {
  static const std::map<std::string, std::string> other_names = {
      {"int", "integer"}, {"bool", "boolean"}, {"float", "number"}, {"double", "number"}, {"str", "string"}};
  if (const auto it = other_names.find(name); it != other_names.end()) return it->second;
  return nearest_name(name, kKindNames);
}

std::string accepts_text(const OptionSpec& spec) {
  std::vector<std::string> parts;
  for (const auto& entry : spec.listed) {
    const auto* kind = std::get_if<OptionKind>(&entry);
    if (kind == nullptr) {
      parts.push_back(lua_text(std::get<PolicyValue>(entry)));
      continue;
    }
    switch (*kind) {
      case OptionKind::integer:
      case OptionKind::number: parts.push_back(numeric_text(spec, *kind == OptionKind::integer)); break;
      case OptionKind::boolean: parts.push_back(spec.listed.size() == 1 ? "true or false" : "a boolean"); break;
      case OptionKind::string: parts.push_back("a string"); break;
      case OptionKind::dtype: parts.push_back("a dtype (float32, bfloat16, float16, float64)"); break;
    }
  }
  std::string text;
  for (size_t i = 0; i < parts.size(); ++i) {
    text += (i == 0 ? "" : i + 1 == parts.size() ? " or " : ", ") + parts[i];
  }
  return text;
}

bool has_kind(const OptionSpec& spec, OptionKind kind) {
  return std::find(spec.kinds.begin(), spec.kinds.end(), kind) != spec.kinds.end();
}

bool in_range(const OptionSpec& spec, double value) {
  return (!spec.min || value >= *spec.min) && (!spec.max || value <= *spec.max);
}

bool accepts(const OptionSpec& spec, const PolicyValue& value) {
  if (std::find(spec.literals.begin(), spec.literals.end(), value) != spec.literals.end()) return true;
  if (std::holds_alternative<bool>(value)) return has_kind(spec, OptionKind::boolean);
  if (const auto* i = std::get_if<int64_t>(&value)) {
    return (has_kind(spec, OptionKind::integer) || has_kind(spec, OptionKind::number)) && in_range(spec, static_cast<double>(*i));
  }
  // NaN falls outside every bound, and inf is no setting a policy could act on.
  if (const auto* d = std::get_if<double>(&value)) {
    return has_kind(spec, OptionKind::number) && std::isfinite(*d) && in_range(spec, *d);
  }
  const auto& s = std::get<std::string>(value);
  if (has_kind(spec, OptionKind::string)) return true;
  if (!has_kind(spec, OptionKind::dtype)) return false;
  try {
    parse_dtype(s);
    return true;
  } catch (const UserError&) {
    return false;
  }
}

// The Lua value at `index` as a PolicyValue: a boolean, number or string.
PolicyValue scalar_at(lua_State* L, int index, const std::string& what) {
  switch (lua_type(L, index)) {
    case LUA_TBOOLEAN: return static_cast<bool>(lua_toboolean(L, index));
    case LUA_TNUMBER:
      if (lua_isinteger(L, index)) return static_cast<int64_t>(lua_tointeger(L, index));
      return lua_tonumber(L, index);
    case LUA_TSTRING: return to_string_arg(L, index, what.c_str());
    default: throw ScriptError(what + ": expected a boolean, number or string, got " + luaL_typename(L, index));
  }
}

std::optional<double> bound_at(lua_State* L, int spec, const char* key, const std::string& what) {
  raw_field(L, spec, key);
  std::optional<double> bound;
  if (!lua_isnil(L, -1)) {
    if (lua_type(L, -1) != LUA_TNUMBER || !std::isfinite(lua_tonumber(L, -1))) {
      throw ScriptError(what + ": " + key + " must be a finite number");
    }
    bound = lua_tonumber(L, -1);
  }
  lua_pop(L, 1);
  return bound;
}

// Reads {kind or literal, ..., min = , max = , default = , doc = } at `spec`.
OptionSpec read_spec(lua_State* L, int spec, const std::string& name) {
  const std::string what = "options: " + name;
  if (!lua_istable(L, spec)) throw ScriptError(what + ": expected a table {kind, ..., default = ..., doc = ...}");
  OptionSpec s;
  const auto n = static_cast<lua_Integer>(lua_rawlen(L, spec));
  const std::vector<std::string> keys = {"min", "max", "default", "doc"};
  for (lua_pushnil(L); lua_next(L, spec) != 0; lua_pop(L, 1)) {
    if (lua_isinteger(L, -2) && lua_tointeger(L, -2) >= 1 && lua_tointeger(L, -2) <= n) continue;  // the list
    const bool named = lua_type(L, -2) == LUA_TSTRING;
    if (named && std::find(keys.begin(), keys.end(), lua_tostring(L, -2)) != keys.end()) continue;
    const std::string near = named ? nearest_name(lua_tostring(L, -2), keys) : "";
    throw ScriptError(what + ": unknown key " + key_text(L, -2) +
                      (near.empty() ? "" : "; did you mean '" + near + "'?"));
  }
  for (lua_Integer i = 1; i <= n; ++i) {
    lua_rawgeti(L, spec, i);
    const PolicyValue entry = scalar_at(L, -1, what);
    lua_pop(L, 1);
    const auto* name = std::get_if<std::string>(&entry);
    if (const auto kind = name != nullptr ? kind_named(*name) : std::nullopt) {
      s.kinds.push_back(*kind);
      s.listed.emplace_back(*kind);
    } else {
      s.literals.push_back(entry);
      s.listed.emplace_back(entry);
    }
  }
  if (s.listed.empty()) throw ScriptError(what + ": names no kind or value it accepts");
  // A string listed alone that is no kind but near one is a misspelt kind: as a literal the
  // option would accept that one value alone, a constant no run file needs to set.
  const auto* lone = s.literals.size() == 1 && s.kinds.empty() ? std::get_if<std::string>(&s.literals.front()) : nullptr;
  if (lone != nullptr) {
    if (const std::string near = kind_meant(*lone); !near.empty()) {
      throw ScriptError(what + ": unknown kind '" + *lone + "'; did you mean '" + near + "'?");
    }
  }
  s.min = bound_at(L, spec, "min", what);
  s.max = bound_at(L, spec, "max", what);
  if ((s.min || s.max) && !has_kind(s, OptionKind::integer) && !has_kind(s, OptionKind::number)) {
    throw ScriptError(what + ": min and max bound numbers, and it takes none (kind \"integer\" or \"number\")");
  }
  if (s.min && s.max && *s.min > *s.max) {
    throw ScriptError(what + ": min " + bound_text(*s.min, false) + " is above max " + bound_text(*s.max, false) +
                      ", so no number is accepted");
  }
  raw_field(L, spec, "doc");
  if (!lua_isnil(L, -1)) s.doc = to_string_arg(L, -1, (what + ": doc").c_str());
  lua_pop(L, 1);
  raw_field(L, spec, "default");
  if (!lua_isnil(L, -1)) s.fallback = scalar_at(L, -1, what + ": default");
  lua_pop(L, 1);
  if (s.fallback && !accepts(s, *s.fallback)) {
    throw ScriptError(what + ": the default " + lua_text(*s.fallback) + " is not " + accepts_text(s));
  }
  return s;
}

const GivenOption* given_option(const PolicyRun& run, const std::string& name) {
  for (const auto& o : run.context.options) {
    if (o.name == name) return &o;
  }
  return nullptr;
}

std::string located(const GivenOption& given) { return given.where.empty() ? "" : given.where + ": "; }

// Where `name` goes in the plan's options, kept sorted by name.
std::vector<PolicyOption>::iterator option_slot(std::vector<PolicyOption>& options, const std::string& name) {
  return std::lower_bound(options.begin(), options.end(), name,
                          [](const PolicyOption& o, const std::string& n) { return o.name < n; });
}

// Whether `option` is declared for the first time; throws where an earlier declaration of
// the same name differs.
bool first_declaration(PolicyRun& run, const PolicyOption& option) {
  const auto at = option_slot(run.plan.options, option.name);
  if (at == run.plan.options.end() || at->name != option.name) return true;
  std::string differ;
  for (const auto& [field, first, again] : {std::tuple{"what it accepts", &at->accepts, &option.accepts},
                                            {"its value", &at->value, &option.value},
                                            {"its doc", &at->doc, &option.doc}}) {
    if (*first != *again) differ += (differ.empty() ? "" : "; ") + std::string(field) + ": " + *first + " there, " + *again + " here";
  }
  if (!differ.empty()) {
    throw ScriptError("options: '" + option.name + "' declared again differently from its declaration at " + at->origin +
                      " (" + differ + ")");
  }
  return false;
}

// Records every option of one options{...} call, or none: past the reserve (which may throw)
// the inserts only move options, which cannot throw.
void declare(PolicyRun& run, std::vector<PolicyOption> fresh) {
  static_assert(std::is_nothrow_move_constructible_v<PolicyOption> && std::is_nothrow_move_assignable_v<PolicyOption>);
  auto& options = run.plan.options;
  options.reserve(options.size() + fresh.size());
  for (auto& option : fresh) options.insert(option_slot(options, option.name), std::move(option));
}

// options{name = spec, ...} -> {name = value in force, ...}
int api_options(lua_State* L) {
  PolicyRun& run = run_of(L);
  if (!lua_istable(L, 1)) throw ScriptError("options expects a table: options{name = {kind, ..., default = ...}, ...}");
  std::vector<std::string> names;
  for (lua_pushnil(L); lua_next(L, 1) != 0; lua_pop(L, 1)) {
    if (lua_type(L, -2) != LUA_TSTRING) throw ScriptError("options: option names must be strings");
    names.push_back(to_string_arg(L, -2, "options: a name"));
    // A run file sets it as a TOML key of [policy.options]: a bare key's letters alone.
    const std::string& name = names.back();
    if (name.empty() || !std::all_of(name.begin(), name.end(), [](unsigned char c) {
          return std::isalnum(c) || c == '_' || c == '-';
        })) {
      throw ScriptError("options: '" + name + "' is no name a run file can set (letters, digits, _ and - alone)");
    }
  }
  std::sort(names.begin(), names.end());
  const std::string origin = caller_location(L);
  // Every entry is read and checked before any is recorded: a call a pcall caught leaves no
  // option declared for the run file to set.
  std::vector<PolicyOption> fresh;
  std::vector<std::pair<std::string, PolicyValue>> in_force;
  for (const auto& name : names) {
    raw_field(L, 1, name.c_str());
    const OptionSpec spec = read_spec(L, lua_gettop(L), name);
    lua_pop(L, 1);
    const GivenOption* given = given_option(run, name);
    if (given != nullptr && !accepts(spec, given->value)) {
      run.option_error = located(*given) + "[policy.options] " + name + ": must be " + accepts_text(spec) + ", got " +
                         lua_text(given->value);
      throw ScriptError(run.option_error);
    }
    const std::optional<PolicyValue> value = given ? std::optional(given->value) : spec.fallback;
    PolicyOption option{.name = name, .accepts = accepts_text(spec), .value = value ? lua_text(*value) : "",
                        .given = given != nullptr, .doc = spec.doc, .origin = origin};
    if (first_declaration(run, option)) fresh.push_back(std::move(option));
    if (value) in_force.emplace_back(name, *value);
  }
  lua_newtable(L);
  for (const auto& [name, value] : in_force) {
    push_policy_value(L, value);
    lua_setfield(L, -2, name.c_str());
  }
  declare(run, std::move(fresh));
  return 1;
}

}  // namespace

void check_given_options(const PolicyRun& run, const std::string& policy) {
  std::vector<std::string> declared;
  for (const auto& o : run.plan.options) declared.push_back(o.name);
  for (const auto& given : run.context.options) {
    if (std::binary_search(declared.begin(), declared.end(), given.name)) continue;
    std::string hint;
    if (declared.empty()) hint = "; it declares no options";
    else if (const std::string near = nearest_name(given.name, declared); !near.empty()) hint = "; did you mean '" + near + "'?";
    else {
      hint = " (its options:";
      for (const auto& name : declared) hint += " " + name;
      hint += ")";
    }
    throw UserError(located(given) + "[policy.options] " + given.name + ": the policy " + policy +
                    " has no such option" + hint);
  }
}

void open_options_api(lua_State* L) {
  lua_register(L, "options", guarded<api_options>);
}

}  // namespace fsdpp::lua
