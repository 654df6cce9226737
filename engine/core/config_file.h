// A run's TOML file, split into sections that each component parses into its own Config.
// Every problem is a UserError naming the file and line (or the --set that caused it), and
// an unknown key or section names the nearest valid one.
#pragma once

#include "core/config_section.h"

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fsdpp {

class ConfigFile {
 public:
  // Parses `path`, then applies overrides "section.key=value" (value read as TOML, or as a
  // string when it does not parse as one), which messages name as `override_label` and the
  // text ("--set train.steps=3", the Python API's "overrides: train.steps=3").
  static ConfigFile load(const std::filesystem::path& path, const std::vector<std::string>& overrides,
                         const std::string& override_label = "--set");
  // The same for the text of a file at `path` (named in messages).
  static ConfigFile parse(const std::string& text, const std::filesystem::path& path,
                          const std::vector<std::string>& overrides, const std::string& override_label = "--set");

  ConfigSection section(const std::string& name) const;
  // Errors for a top-level entry that is not one of `known` sections, blamed on the --set
  // that made it when no line of the file did.
  void check_sections(const std::vector<std::string>& known) const;
  // Every section's keys, so that a key given in the wrong section is pointed to its own.
  void set_section_keys(std::map<std::string, std::vector<std::string>> keys);
  // ConfigSection::where of `key` in `section`.
  std::string where(const std::string& section, const std::string& key) const;
  const std::filesystem::path& path() const;
  // The document after overrides as normalised TOML (keys sorted, comments and layout
  // dropped), leaving out the `excluded` sections and "section.key" entries: equal texts
  // mean equal settings.
  std::string canonical_text(const std::vector<std::string>& excluded = {}) const;
  // Every value of the document after overrides by its dotted key ("optimizer.lr",
  // "policy.options.lora_rank") as TOML text, leaving out the `excluded` sections and keys
  // (and what lies under them): equal maps mean equal settings.
  std::map<std::string, std::string> settings(const std::vector<std::string>& excluded = {}) const;
  ConfigFile() = default;

 private:
  std::shared_ptr<ConfigDocument> doc_;
};

}  // namespace fsdpp
