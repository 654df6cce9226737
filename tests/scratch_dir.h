// A fresh scratch directory per test process and tag, for tests that write real files. Every
// directory a process made is removed when it exits normally; one that dies keeps its files
// for a look.
#pragma once

#include "core/mapped_file.h"

#include <unistd.h>

#include <exception>
#include <filesystem>
#include <set>
#include <string>

namespace fsdpp::testing {

inline std::filesystem::path scratch_dir(const std::string& tag) {
  struct MadeDirs {
    std::set<std::filesystem::path> paths;
    ~MadeDirs() {
      for (const auto& path : paths) {
        try {
          remove_tree(path);
        } catch (const std::exception&) {
          // A directory that cannot go stays behind; the tests' results stand.
        }
      }
    }
  };
  static MadeDirs made;
  auto dir = std::filesystem::temp_directory_path() / ("fsdpp-" + tag + "-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  made.paths.insert(dir);
  return dir;
}

}  // namespace fsdpp::testing
