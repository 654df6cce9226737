// spdlog-backed implementation of core/log.h; built without LibTorch's include paths.
#include "core/log.h"

#include "core/error.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

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
  // --verbose adds keeps its lines (a Lua traceback is several).
  const std::string message = level == LogLevel::debug ? text : one_line(text);
  switch (level) {
    case LogLevel::debug: logger().debug(message); break;
    case LogLevel::info: logger().info(message); break;
    case LogLevel::warn: logger().warn(message); break;
    case LogLevel::error: logger().error(message); break;
  }
}

}  // namespace fsdpp
