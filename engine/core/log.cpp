// spdlog-backed implementation of core/log.h; built without LibTorch's include paths.
#include "core/log.h"

#include "core/error.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>

namespace fsdpp {

namespace {

spdlog::logger& logger() {
  static auto instance = [] {
    auto l = spdlog::stderr_color_mt("fsdpp");
    l->set_pattern("%H:%M:%S %^%l%$ %v");
    return l;
  }();
  return *instance;
}

}  // namespace

void set_log_rank(int rank) {
  logger().set_pattern(rank < 0 ? "%H:%M:%S %^%l%$ %v"
                                 : "%H:%M:%S [rank " + std::to_string(rank) + "] %^%l%$ %v");
}

void set_log_verbose(bool verbose) { logger().set_level(verbose ? spdlog::level::debug : spdlog::level::info); }

void log_line(LogLevel level, const std::string& text) {
  // One line, whatever a path or a name in it holds (a byte of no UTF-8, a line break); what
  // --verbose adds keeps its line breaks and tabs (a Lua traceback's layout) and escapes the
  // rest alike, since a traceback quotes the script's own error message.
  std::string message;
  if (level == LogLevel::debug) {
    for (size_t start = 0; start <= text.size();) {
      const size_t end = std::min(text.find_first_of("\n\t", start), text.size());
      message += one_line(text.substr(start, end - start));
      if (end < text.size()) message += text[end];
      start = end + 1;
    }
  } else {
    message = one_line(text);
  }
  switch (level) {
    case LogLevel::debug: logger().debug(message); break;
    case LogLevel::info: logger().info(message); break;
    case LogLevel::warn: logger().warn(message); break;
    case LogLevel::error: logger().error(message); break;
  }
}

}  // namespace fsdpp
