// ConfigSection's typed getters over the shared ConfigDocument (core/config_document.h).
#include "core/config_section.h"

#include "core/config_document.h"
#include "core/error.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>

namespace fsdpp {

namespace {

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

}  // namespace

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

std::string nearest_name(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = SIZE_MAX;
  for (const auto& c : candidates) {
    const size_t d = edit_distance(word, c);
    const size_t longer = std::max(word.size(), c.size());
    // A slip: two edits (letters swapped), or a third of the longer word's letters. Where every
    // letter of the longer word changes ("zz" and "b"), the two share nothing.
    if (d < best_distance && d <= std::max<size_t>(2, longer / 3) && d < longer) {
      best_distance = d;
      best = c;
    }
  }
  return best;
}

std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best = nearest_name(word, candidates);
  return best.empty() ? "" : "; did you mean '" + best + "'?";
}

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


ConfigSection::ConfigSection(std::shared_ptr<const ConfigDocument> doc, std::string name)
    : doc_(std::move(doc)), name_(std::move(name)) {}

std::string ConfigSection::where(const std::string& key) const {
  // The --set that gave the key, or one that gave a table holding it ("--set
  // policy.options={x=1}" for options.x).
  for (std::string setting = name_ + "." + key;;) {
    if (auto over = doc_->overridden.find(setting); over != doc_->overridden.end()) {
      return doc_->override_label + " " + over->second;
    }
    const auto dot = setting.rfind('.');
    if (dot == std::string::npos) break;
    setting.resize(dot);
  }
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

}  // namespace fsdpp
