// One [section] of a run file, read into a component's typed Config: each getter checks the
// value's type and range where it enters, and finish() names every key no getter asked for.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace fsdpp {

struct ConfigDocument;

using ConfigScalar = std::variant<bool, int64_t, double, std::string>;

// The largest step count or step interval a run file may name: a trillion, beyond any run,
// and far from where step arithmetic could overflow.
inline constexpr int64_t kMaxSteps = 1'000'000'000'000;
inline constexpr int64_t kMaxSeed = INT64_MAX;

class ConfigSection {
 public:
  ConfigSection(std::shared_ptr<const ConfigDocument> doc, std::string name);

  // Every number is range-checked where it enters: a value outside [min, max] (or [min, max)
  // where max is excluded) is a failure naming the range. Floats must be finite; integers are
  // accepted for them.
  enum class Max { included, excluded };
  int64_t get_int(const std::string& key, int64_t fallback, int64_t min, int64_t max);
  double get_double(const std::string& key, double fallback, double min, double max, Max bound = Max::included);
  bool get_bool(const std::string& key, bool fallback);
  std::string get_string(const std::string& key, const std::string& fallback);
  // The value of the named choice (`fallback` when the key is absent); any other name is a
  // failure listing them all.
  template <typename T>
  T get_choice(const std::string& key, T fallback, std::initializer_list<std::pair<const char*, T>> choices);
  // A sub-table of scalars ([section.key]), in file order; nested tables and arrays are errors.
  std::vector<std::pair<std::string, ConfigScalar>> get_scalar_table(const std::string& key);

  // Errors for keys never asked for, naming the nearest key that was, or the section a key
  // belongs to (ConfigFile::set_section_keys).
  void finish() const;
  // The keys asked for so far.
  std::vector<std::string> asked() const;
  // A validation failure of `key`: "file:line: [section] key: message".
  [[noreturn]] void fail(const std::string& key, const std::string& message) const;
  const std::string& name() const { return name_; }
  // Where `key` was given: "file:line" (the section's line when the key is absent) or the
  // "--set ..." that set it.
  std::string where(const std::string& key) const;

 private:
  const void* lookup(const std::string& key, const char* expected);
  // Every string here is a path or a name: a NUL would end a path at it, naming another file
  // than the one written, and a line break or other control character would break the log
  // lines that name it.
  void check_printable(const std::string& key, const std::string& value) const;

  std::shared_ptr<const ConfigDocument> doc_;
  std::string name_;
  std::set<std::string> asked_;
};

template <typename T>
T ConfigSection::get_choice(const std::string& key, T fallback, std::initializer_list<std::pair<const char*, T>> choices) {
  std::string fallback_name;
  for (const auto& [choice, value] : choices) {
    if (value == fallback && fallback_name.empty()) fallback_name = choice;
  }
  const std::string name = get_string(key, fallback_name);
  std::string names;
  for (const auto& [choice, value] : choices) {
    if (name == choice) return value;
    names += (names.empty() ? "" : ", ") + std::string(choice);
  }
  fail(key, "'" + name + "' is not one of " + names);
}

// The candidate closest to `word` by edit distance ("" when none is close).
std::string nearest_name(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace fsdpp
