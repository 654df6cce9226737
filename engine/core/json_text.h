// JSON read from files a user hands over (config.json, safetensors headers, weight indexes,
// adapter configs, checkpoint metadata, sample lines). nlohmann's values copy, compare, print
// and free themselves recursively, so a file nested a hundred thousand deep would overflow the
// stack wherever one of them is used: nesting is bounded while the text is parsed, where the
// parser keeps its own stack.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>
#include <string_view>

namespace fsdpp {

// Deeper than any file fsdpp reads needs (config.json's deepest, rope_scaling, is 3 down).
inline constexpr int kMaxJsonDepth = 64;

// The largest JSON text fsdpp parses: 1 GiB, far past any config.json, weight index or
// adapter config.
inline constexpr size_t kMaxJsonBytes = size_t{1} << 30;

// `text` parsed. UserError "`where`: not valid JSON (...)" for a syntax error or a number
// past double's range, "`where`: nested deeper than 64 levels" for a value too deep, one
// naming the key for an object that holds a key twice, and one naming its size for a text
// past kMaxJsonBytes.
nlohmann::json parse_json(std::string_view text, const std::string& where);

}  // namespace fsdpp
