// TOML parsing through toml++, kept to this one unit so no other header pulls it in.
#include "core/config_file.h"

#include "core/error.h"

#include <toml++/toml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string_view>

namespace fsdpp {

struct ConfigDocument {
  std::filesystem::path path;
  toml::table root;
  std::map<std::string, std::string> overridden;  // "section.key" -> the --set text
  std::string override_label = "--set";           // how messages name an override: "--set" or the caller's word
  std::map<std::string, std::vector<std::string>> section_keys;  // every section's keys, for hints
};

namespace {

std::string type_name(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    default: return "a date or time";
  }
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t next = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = row[j];
      row[j] = next;
    }
  }
  return row[b.size()];
}

std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best = nearest_name(word, candidates);
  return best.empty() ? "" : "; did you mean '" + best + "'?";
}

// The value of `key` in [section], or in a sub-table of it ("options.x"); nullptr if absent.
const toml::node* node_at(const ConfigDocument& doc, const std::string& section, const std::string& key) {
  const toml::table* table = doc.root.get_as<toml::table>(section);
  if (table == nullptr) return nullptr;
  if (const toml::node* node = table->get(key)) return node;
  // A key of a sub-table ("options.a.b"), whose own name may hold dots: read as a path, its
  // quoted "a.b" would be two keys that are not there.
  const auto dot = key.find('.');
  if (dot == std::string::npos) return nullptr;
  const toml::table* inner = table->get_as<toml::table>(key.substr(0, dot));
  return inner == nullptr ? nullptr : inner->get(key.substr(dot + 1));
}

}  // namespace

std::string nearest_name(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = std::max<size_t>(3, word.size() / 2) + 1;
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    if (d < best_distance) {
      best_distance = d;
      best = c;
    }
  }
  return best;
}

ConfigSection::ConfigSection(std::shared_ptr<const ConfigDocument> doc, std::string name)
    : doc_(std::move(doc)), name_(std::move(name)) {}

std::string ConfigSection::where(const std::string& key) const {
  auto over = doc_->overridden.find(name_ + "." + key);
  if (over != doc_->overridden.end()) return doc_->override_label + " " + over->second;
  const toml::node* node = node_at(*doc_, name_, key);
  if (node == nullptr) node = doc_->root.get(name_);
  std::string location = doc_->path.string();
  if (node != nullptr && node->source().begin.line > 0) {
    location += ":" + std::to_string(node->source().begin.line);
  }
  return location;
}

void ConfigSection::fail(const std::string& key, const std::string& message) const {
  throw UserError(where(key) + ": [" + name_ + "] " + key + ": " + message);
}

const void* ConfigSection::lookup(const std::string& key, const char* expected) {
  asked_.insert(key);
  const toml::node* node = node_at(*doc_, name_, key);
  if (node == nullptr) return nullptr;
  const bool ok = (std::string(expected) == "a float" && (node->is_floating_point() || node->is_integer())) ||
                  type_name(*node) == expected;
  if (!ok) fail(key, std::string("expected ") + expected + ", got " + type_name(*node));
  return node;
}

int64_t ConfigSection::get_int(const std::string& key, int64_t fallback, int64_t min, int64_t max) {
  auto* node = static_cast<const toml::node*>(lookup(key, "an integer"));
  if (node == nullptr) return fallback;
  const int64_t value = **node->as_integer();
  if (value < min || value > max) {
    fail(key, "must be in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " + std::to_string(value));
  }
  return value;
}

double ConfigSection::get_double(const std::string& key, double fallback, double min, double max, Max bound) {
  auto* node = static_cast<const toml::node*>(lookup(key, "a float"));
  if (node == nullptr) return fallback;
  // An integer too large for a double converts with rounding; the range check then applies.
  const double value = node->is_integer() ? static_cast<double>(**node->as_integer()) : **node->as_floating_point();
  const bool above = bound == Max::included ? value > max : value >= max;
  if (!std::isfinite(value) || value < min || above) {
    std::ostringstream message;
    message << "must be a finite number in [" << min << ", " << max << (bound == Max::included ? "]" : ")")
            << ", got " << value;
    fail(key, message.str());
  }
  return value;
}

bool ConfigSection::get_bool(const std::string& key, bool fallback) {
  auto* node = static_cast<const toml::node*>(lookup(key, "a boolean"));
  return node ? node->value<bool>().value() : fallback;
}

std::string ConfigSection::get_string(const std::string& key, const std::string& fallback) {
  auto* node = static_cast<const toml::node*>(lookup(key, "a string"));
  if (node == nullptr) return fallback;
  std::string value = node->value<std::string>().value();
  check_printable(key, value);
  return value;
}

void ConfigSection::check_printable(const std::string& key, const std::string& value) const {
  for (const unsigned char c : value) {
    if (c < 0x20 || c == 0x7f) {
      char shown[8];
      std::snprintf(shown, sizeof shown, "\\u%04x", c);
      fail(key, std::string("holds a control character (") + shown + ")");
    }
  }
}

std::vector<std::pair<std::string, ConfigScalar>> ConfigSection::get_scalar_table(const std::string& key) {
  auto* node = static_cast<const toml::node*>(lookup(key, "a table"));
  std::vector<std::pair<std::string, ConfigScalar>> out;
  if (node == nullptr) return out;
  for (const auto& [k, v] : *node->as_table()) {
    const std::string name(k.str());
    // Each read in its own type alone: toml++ converts a float to an integer on request,
    // which overflows for one past int64's range.
    if (v.is_integer()) out.emplace_back(name, *v.value<int64_t>());
    else if (v.is_floating_point()) out.emplace_back(name, *v.value<double>());
    else if (v.is_boolean()) out.emplace_back(name, *v.value<bool>());
    else if (v.is_string()) {
      check_printable(key + "." + name, *v.value<std::string>());
      out.emplace_back(name, *v.value<std::string>());
    }
    else fail(key + "." + name, "expected a string, number or boolean, got " + type_name(v));
  }
  return out;
}

void ConfigSection::finish() const {
  const toml::table* table = doc_->root.get_as<toml::table>(name_);
  if (table == nullptr) return;
  std::vector<std::string> valid(asked_.begin(), asked_.end());
  for (const auto& [key, node] : *table) {
    std::string k(key.str());
    if (asked_.count(k)) continue;
    std::string hint = did_you_mean(k, valid);
    for (const auto& [section, keys] : doc_->section_keys) {  // the key, in the section it belongs to
      if (hint.empty() && section != name_ && std::find(keys.begin(), keys.end(), k) != keys.end()) {
        hint = "; " + k + " is a key of [" + section + "]";
      }
    }
    fail(k, "unknown key" + hint);
  }
}

std::vector<std::string> ConfigSection::asked() const { return {asked_.begin(), asked_.end()}; }

namespace {

// toml++'s description of a syntax error in plain words, where it has a common cause.
std::string plain_words(const std::string& description) {
  static const std::vector<std::pair<const char*, const char*>> causes = {
      {"control characters", "a quoted string is not closed on its line (a missing quote?)"},
      {"could not determine value type",
       "the value is not a number, true/false, a \"quoted string\", a [list] or a {table} (text needs quotes)"},
      {"cannot redefine existing", "a key or [section] is given twice"},
      {"table header: expected ']'", "a [section] header is missing its ']'"},
      {"encountered end-of-file", "the file ends inside a value (an unclosed [, { or quote?)"},
      {"expected a comment or whitespace", "more follows a value on its line (one key = value per line)"},
      {"expected '='", "a key must be followed by '=' and its value"},
      {"expected keys, tables", "a line must be key = value, a [section] header or a # comment"},
  };
  for (const auto& [cause, words] : causes) {
    if (description.find(cause) != std::string::npos) return words;
  }
  return description;
}

// The most dotted parts a key may have: the run file's deepest is three (policy.options.x).
// The TOML parser builds and frees a dotted key's tables by recursion, so a key of a hundred
// thousand parts would end the process in a stack overflow rather than an error.
constexpr size_t kMaxKeyParts = 32;

// Where a quoted string that opens at text[at] ends (one past its closing quote, or at the line
// break an unclosed one-line string stops at); `line` counts the breaks inside it.
size_t skip_string(std::string_view text, size_t at, int& line) {
  const char quote = text[at];
  const bool basic = quote == '"';  // only basic strings have escapes
  const bool multi_line = text.substr(at, 3) == std::string(3, quote);
  for (size_t i = at + (multi_line ? 3 : 1); i < text.size(); ++i) {
    if (basic && text[i] == '\\') {
      if (i + 1 < text.size() && text[i + 1] == '\n') ++line;
      ++i;
    } else if (text[i] == '\n') {
      if (!multi_line) return i;
      ++line;
    } else if (text[i] == quote && (!multi_line || text.substr(i, 3) == std::string(3, quote))) {
      if (!multi_line) return i + 1;
      size_t end = i + 3;  // up to two more quotes close the string as its own last characters
      while (end < text.size() && end < i + 5 && text[end] == quote) ++end;
      return end;
    }
  }
  return text.size();
}

struct DeepKey {
  int line;
  size_t parts;
};

// The first key in TOML `text` with more than kMaxKeyParts parts, wherever a key stands: a
// line's key, a [table] header, a key inside an inline table. Outside strings and comments a
// dot belongs to a dotted key or to a number or date, which holds one at most; so more dots
// between the marks that end keys and values (= , { } [ ] and line breaks) are a key's.
std::optional<DeepKey> find_deep_key(std::string_view text) {
  int line = 1;
  DeepKey run{1, 1};  // the parts of the key being read, and the line it is on
  for (size_t i = 0; i <= text.size(); ++i) {
    const char c = i < text.size() ? text[i] : '\n';
    if (c == '"' || c == '\'') {
      i = skip_string(text, i, line) - 1;
    } else if (c == '#') {
      i = std::min(text.find('\n', i), text.size()) - 1;
    } else if (c == '.') {
      if (run.parts++ == 1) run.line = line;
    } else if (std::string_view("=,{}[]\n").find(c) != std::string_view::npos) {
      if (run.parts > kMaxKeyParts) return run;
      run.parts = 1;
      if (c == '\n') ++line;
    }
  }
  return std::nullopt;
}

// Refuses a file whose find_deep_key finds a key, before the parser meets it.
void check_key_depth(const std::string& text, const std::filesystem::path& path) {
  if (const auto deep = find_deep_key(text)) {
    throw UserError(path.string() + ":" + std::to_string(deep->line) + ": a key of " + std::to_string(deep->parts) +
                    " dotted parts; at most " + std::to_string(kMaxKeyParts));
  }
}

// Applies one --set "section.key=value" to `doc`: the value read as TOML, or as a string when
// it is a bare word (runs/x, bf16) that does not parse as TOML; a quoted, array or table value
// that does not parse is an error.
void apply_override(ConfigDocument& doc, const std::string& text) {
  const std::string given = doc.override_label + " " + text;  // how messages name it
  const auto eq = text.find('=');
  const auto dot = text.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq) {
    throw UserError(given + ": expected section.key=value");
  }
  const std::string section = text.substr(0, dot), key = text.substr(dot + 1, eq - dot - 1);
  const std::string value = text.substr(eq + 1);
  // The setting's key, or one inside a table value; a bare word's dots (runs/v1.2) are no key's.
  const auto first = value.find_first_not_of(" \t");
  const bool table_value = first != std::string::npos && (value[first] == '{' || value[first] == '[');
  auto deep = find_deep_key(text.substr(0, eq));
  if (!deep && table_value) deep = find_deep_key(value);
  if (deep) {
    throw UserError(doc.override_label + " " + text.substr(0, 64) + "...: a key of " + std::to_string(deep->parts) +
                    " dotted parts; at most " + std::to_string(kMaxKeyParts));
  }
  // One setting: a line break would let the rest of it be read as more TOML.
  if (std::any_of(text.begin(), text.end(), [](unsigned char c) { return c < 0x20 && c != '\t'; })) {
    throw UserError(given + ": holds a line break or control character");
  }
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value);
  } catch (const toml::parse_error& e) {
    // A quoted, array or table value, or a whole number too long for 64 bits, is not a bare
    // word (a shorter one fails for a leading zero alone: "0001" stays a name).
    const size_t sign = !value.empty() && (value[0] == '-' || value[0] == '+') ? 1 : 0;
    const bool whole_number = value.size() >= sign + 19 && value.find_first_not_of("0123456789", sign) == std::string::npos;
    const bool quoted = !value.empty() && std::string_view("\"'[{").find(value.front()) != std::string_view::npos;
    if (whole_number || quoted) {
      throw UserError(given + ": invalid TOML value: " + plain_words(std::string(e.description())));
    }
    parsed.insert("v", value);
  }
  // "policy.options.shard" names a key in a nested table; create the tables on the way, each
  // one the --set's to answer for. A value the file gives on the way is not a table to enter.
  toml::table* table = &doc.root;
  std::string rest = section + "." + key, reached;
  for (size_t dot_at; (dot_at = rest.find('.')) != std::string::npos; rest = rest.substr(dot_at + 1)) {
    const std::string part = rest.substr(0, dot_at);
    reached += (reached.empty() ? "" : ".") + part;
    if (const toml::node* there = table->get(part); there != nullptr && !there->is_table()) {
      throw UserError(given + ": " + reached + " is a value, not a table of keys");
    }
    if (!table->get_as<toml::table>(part)) {
      table->insert_or_assign(part, toml::table{});
      doc.overridden.emplace(reached, text);
    }
    table = table->get_as<toml::table>(part);
  }
  table->insert_or_assign(rest, *parsed.get("v"));
  doc.overridden[section + "." + key] = text;
}

}  // namespace

ConfigFile ConfigFile::load(const std::filesystem::path& path, const std::vector<std::string>& overrides,
                            const std::string& override_label) {
  if (!std::filesystem::exists(path)) throw UserError(path.string() + ": no such config file");
  // A FIFO or device in its place would block the read or never end.
  if (!std::filesystem::is_regular_file(path)) throw UserError(path.string() + ": not a regular file");
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in) throw UserError(path.string() + ": cannot be read");
  return parse(text.str(), path, overrides, override_label);
}

ConfigFile ConfigFile::parse(const std::string& text, const std::filesystem::path& path,
                             const std::vector<std::string>& overrides, const std::string& override_label) {
  ConfigFile file;
  file.doc_ = std::make_shared<ConfigDocument>();
  file.doc_->path = path;
  file.doc_->override_label = override_label;
  check_key_depth(text, path);
  try {
    file.doc_->root = toml::parse(text, path.string());
  } catch (const toml::parse_error& e) {
    throw UserError(path.string() + ":" + std::to_string(e.source().begin.line) +
                    ": invalid TOML: " + plain_words(std::string(e.description())));
  }
  for (const auto& override_text : overrides) apply_override(*file.doc_, override_text);
  return file;
}

ConfigSection ConfigFile::section(const std::string& name) const {
  const toml::node* node = doc_->root.get(name);
  if (node != nullptr && !node->is_table()) {
    throw UserError(doc_->path.string() + ":" + std::to_string(node->source().begin.line) + ": '" +
                    name + "' must be a [section], not " + type_name(*node));
  }
  return ConfigSection(doc_, name);
}

void ConfigFile::check_sections(const std::vector<std::string>& known) const {
  for (const auto& [key, node] : doc_->root) {
    std::string k(key.str());
    if (std::find(known.begin(), known.end(), k) != known.end()) continue;
    std::string where = doc_->path.string();
    if (node.source().begin.line > 0) {
      where += ":" + std::to_string(node.source().begin.line);
    } else {  // a section only a --set made
      for (const auto& [setting, text] : doc_->overridden) {
        if (setting.starts_with(k + ".")) where = doc_->override_label + " " + text;
      }
    }
    throw UserError(where + ": unknown section [" + k + "]" + did_you_mean(k, known));
  }
}

void ConfigFile::set_section_keys(std::map<std::string, std::vector<std::string>> keys) {
  doc_->section_keys = std::move(keys);
}

std::string ConfigFile::where(const std::string& section, const std::string& key) const {
  return ConfigSection(doc_, section).where(key);
}

const std::filesystem::path& ConfigFile::path() const { return doc_->path; }

std::string ConfigFile::canonical_text(const std::vector<std::string>& excluded) const {
  toml::table copy = doc_->root;
  for (const auto& name : excluded) {
    const auto dot = name.find('.');
    if (dot == std::string::npos) {
      copy.erase(name);
    } else if (auto* section = copy[name.substr(0, dot)].as_table()) {
      section->erase(name.substr(dot + 1));
    }
  }
  std::ostringstream out;
  out << toml::toml_formatter(copy, toml::format_flags::none);
  return out.str();
}

std::map<std::string, std::string> ConfigFile::settings(const std::vector<std::string>& excluded) const {
  std::map<std::string, std::string> out;
  const auto left_out = [&](const std::string& key) {
    return std::any_of(excluded.begin(), excluded.end(),
                       [&](const std::string& e) { return key == e || key.starts_with(e + "."); });
  };
  const auto walk = [&](const auto& self, const toml::table& table, const std::string& prefix) -> void {
    for (const auto& [k, node] : table) {
      const std::string key = prefix + std::string(k.str());
      if (left_out(key)) continue;
      if (const auto* inner = node.as_table()) {
        self(self, *inner, key + ".");
        continue;
      }
      std::ostringstream text;
      // A finite float as its shortest exact text (0.0005, where TOML's writer gives 17 digits).
      if (const auto number = node.template value<double>(); node.is_floating_point() && std::isfinite(*number)) {
        char shortest[32];
        const auto end = std::to_chars(shortest, shortest + sizeof shortest, *number, std::chars_format::general).ptr;
        text << std::string_view(shortest, static_cast<size_t>(end - shortest));
      } else {
        node.visit([&](const auto& value) { text << value; });
      }
      out[key] = text.str();
    }
  };
  walk(walk, doc_->root, "");
  return out;
}

}  // namespace fsdpp
