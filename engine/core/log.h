// The engine's logger. spdlog sits behind this header in its own unit because LibTorch
// bundles an fmt that clashes with the system spdlog's; callers pass streamable parts.
#pragma once

#include <sstream>
#include <string>

namespace fsdpp {

enum class LogLevel { debug, info, warn, error };

void log_line(LogLevel level, const std::string& message);
// Routes log lines to stderr with a rank prefix once ranks exist; -1 means none.
void set_log_rank(int rank);
// Debug lines (a policy error's traceback) are written only when verbose.
void set_log_verbose(bool verbose);

template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

template <class... Parts>
void log_info(const Parts&... parts) { log_line(LogLevel::info, concat(parts...)); }
template <class... Parts>
void log_warn(const Parts&... parts) { log_line(LogLevel::warn, concat(parts...)); }

}  // namespace fsdpp
