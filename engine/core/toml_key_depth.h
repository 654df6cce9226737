// Keys too deep for the TOML parser, found in the text before it parses it: toml++ builds and
// frees a dotted key's tables by recursion, so a run file (or a --set) must be refused here.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace fsdpp {

// The most dotted parts a key may have: the run file's deepest is three (policy.options.x),
// and a key of a hundred thousand would end the parser in a stack overflow.
inline constexpr size_t kMaxKeyParts = 32;

struct DeepKey {
  int line;      // the line the key starts on, from 1
  size_t parts;  // its dotted parts, more than kMaxKeyParts

  // "a key of N dotted parts; at most 32"
  std::string message() const;
};

// The first key in TOML `text` with more than kMaxKeyParts parts, wherever a key stands: a
// line's key, a [table] header, a key inside an inline table. Outside strings and comments a
// dot belongs to a dotted key or to a number or date, which holds one at most; so more dots
// between the marks that end keys and values (= , { } [ ] and line breaks) are a key's.
std::optional<DeepKey> find_deep_key(std::string_view text);

}  // namespace fsdpp
