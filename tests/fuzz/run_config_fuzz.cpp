// Fuzzes a run's TOML file through every section's parser. A last line starting with
// "--set " is taken off the file and applied as a command-line override, so overrides are
// fuzzed too.
#include "fuzz_case.h"
#include "run/run_config.h"

#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text = fsdpp::fuzz_text(data, size);
  std::vector<std::string> overrides;
  const size_t last = text.rfind('\n');
  if (last != std::string::npos && text.compare(last + 1, 6, "--set ") == 0) {
    overrides.push_back(text.substr(last + 7));
    text.resize(last);
  }
  return fsdpp::fuzz_case([&] { fsdpp::RunConfig::parse(fsdpp::ConfigFile::parse(text, "run.toml", overrides)); });
}
