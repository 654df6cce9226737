// Errors a user can fix (bad config, missing file, corrupt checkpoint). The CLI prints them
// as one line and exits with status 2; anything else escaping is an engine bug.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>

namespace fsdpp {

// `text` with control characters written as \n, \t or \xNN: a key or line quoted from a
// bad file can never break the one line an error is printed on.
inline std::string one_line(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (const unsigned char c : text) {
    if (c >= 0x20 && c != 0x7f) {
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else {
      char code[5];
      std::snprintf(code, sizeof code, "\\x%02x", c);
      out += code;
    }
  }
  return out;
}

class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& message) : std::runtime_error(one_line(message)) {}
};

}  // namespace fsdpp
