// Errors a user can fix (bad config, missing file, corrupt checkpoint). The CLI prints them
// as one line and exits with status 2; anything else escaping is an engine bug.
#pragma once

#include <stdexcept>
#include <string>

namespace fsdpp {

class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace fsdpp
