// A fresh scratch directory per test process and tag, for tests that write real files.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

namespace fsdpp::testing {

inline std::filesystem::path scratch_dir(const std::string& tag) {
  auto dir = std::filesystem::temp_directory_path() / ("fsdpp-" + tag + "-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace fsdpp::testing
