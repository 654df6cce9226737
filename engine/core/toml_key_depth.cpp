// The scan behind find_deep_key: TOML's strings and comments skipped, dots counted between
// the marks that end keys and values.
#include "core/toml_key_depth.h"

#include <algorithm>

namespace fsdpp {

namespace {

// Where a quoted string that opens at text[at] ends (one past its closing quote, or at the line
// break an unclosed one-line string stops at); `line` counts the breaks inside it.
size_t skip_string(std::string_view text, size_t at, int& line) {
  const char quote = text[at];
  const bool basic = quote == '"';  // only basic strings have escapes
  const bool multi_line = text.substr(at, 3) == std::string(3, quote);
  for (size_t i = at + (multi_line ? 3 : 1); i < text.size(); ++i) {
    if (basic && text[i] == '\\') {
      if (i + 1 < text.size() && text[i + 1] == '\n') ++line;
      ++i;
    } else if (text[i] == '\n') {
      if (!multi_line) return i;
      ++line;
    } else if (text[i] == quote && (!multi_line || text.substr(i, 3) == std::string(3, quote))) {
      if (!multi_line) return i + 1;
      size_t end = i + 3;  // up to two more quotes close the string as its own last characters
      while (end < text.size() && end < i + 5 && text[end] == quote) ++end;
      return end;
    }
  }
  return text.size();
}

}  // namespace

std::string DeepKey::message() const {
  return "a key of " + std::to_string(parts) + " dotted parts; at most " + std::to_string(kMaxKeyParts);
}

std::optional<DeepKey> find_deep_key(std::string_view text) {
  int line = 1;
  DeepKey run{1, 1};  // the parts of the key being read, and the line it is on
  for (size_t i = 0; i <= text.size(); ++i) {
    const char c = i < text.size() ? text[i] : '\n';
    if (c == '"' || c == '\'') {
      i = skip_string(text, i, line) - 1;
    } else if (c == '#') {
      i = std::min(text.find('\n', i), text.size()) - 1;
    } else if (c == '.') {
      if (run.parts++ == 1) run.line = line;
    } else if (std::string_view("=,{}[]\n").find(c) != std::string_view::npos) {
      if (run.parts > kMaxKeyParts) return run;
      run.parts = 1;
      if (c == '\n') ++line;
    }
  }
  return std::nullopt;
}

}  // namespace fsdpp
