// The parsed run file that ConfigFile and its ConfigSections share: toml++'s table, kept to
// the two units of fsdpp_config so no other header pulls toml++ in.
#pragma once

#include <toml++/toml.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace fsdpp {

struct ConfigDocument {
  std::filesystem::path path;
  toml::table root;
  std::map<std::string, std::string> overridden;  // "section.key" -> the --set text
  std::string override_label = "--set";           // how messages name an override: "--set" or the caller's word
  std::map<std::string, std::vector<std::string>> section_keys;  // every section's keys, for hints
};

// "a string", "an integer", ...: a node's type as messages name it.
std::string type_name(const toml::node& node);
// "; did you mean 'x'?" for the candidate nearest `word`, or "" when none is near.
std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates);
// The value of `key` in [section], or in a sub-table of it ("options.x"); nullptr if absent.
const toml::node* node_at(const ConfigDocument& doc, const std::string& section, const std::string& key);

}  // namespace fsdpp
