// Lists of names in one-line messages: the first few, then how many more, so that a list of
// thousands (a MoE model's tensors) never floods the line it is said on.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

namespace fsdpp {

// "a, b, c and 4 more": the first `shown` of `names`, comma-separated, then the count of the rest.
inline std::string first_names(const std::vector<std::string>& names, size_t shown) {
  std::string text;
  for (size_t i = 0; i < std::min(names.size(), shown); ++i) text += (i ? ", " : "") + names[i];
  if (names.size() > shown) text += " and " + std::to_string(names.size() - shown) + " more";
  return text;
}

}  // namespace fsdpp
