// ConfigFile: a run file parsed through toml++, its --set overrides applied, and the forms
// in which runs compare their settings.
#include "core/config_file.h"

#include "core/config_document.h"
#include "core/error.h"
#include "core/toml_key_depth.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string_view>

namespace fsdpp {

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
    throw UserError(doc.override_label + " " + text.substr(0, 64) + "...: " + deep->message());
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
  if (const auto deep = find_deep_key(text)) {
    throw UserError(path.string() + ":" + std::to_string(deep->line) + ": " + deep->message());
  }
  // toml++ reads a NUL as the end of its input, and reports what that leaves open (a quote,
  // a table) instead of the byte.
  if (const size_t nul = text.find('\0'); nul != std::string::npos) {
    const auto line = 1 + std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(nul), '\n');
    throw UserError(path.string() + ":" + std::to_string(line) + ": holds a NUL byte (not a text file?)");
  }
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
