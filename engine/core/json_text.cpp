// Parsing with the nesting bound: values past it are dropped as the parser meets them (so
// none is ever built), then the whole text is refused.
#include "core/json_text.h"

#include "core/error.h"

#include <set>
#include <string>
#include <vector>

namespace fsdpp {

nlohmann::json parse_json(std::string_view text, const std::string& where) {
  using nlohmann::json;
  using Event = json::parse_event_t;
  bool too_deep = false;
  // The keys of each object open at the parser's position: nlohmann keeps the last of two
  // equal keys silently, which would read a different value than another reader may.
  std::vector<std::set<std::string>> open_objects;
  std::string repeated_key;
  const json::parser_callback_t bound = [&](int depth, Event event, json& parsed) {
    if (too_deep || !repeated_key.empty()) return false;  // the text is refused: build nothing more
    if ((event == Event::object_start || event == Event::array_start) && depth > kMaxJsonDepth) {
      too_deep = true;
      return false;
    }
    if (event == Event::object_start) open_objects.emplace_back();
    if (event == Event::object_end) open_objects.pop_back();
    if (event == Event::key && !open_objects.back().insert(parsed.get<std::string>()).second) {
      repeated_key = parsed.get<std::string>();
      return false;
    }
    return true;
  };
  // Parsed values take about twenty times their text: a text past the bound would take the
  // machine's memory, and a failure to allocate ends the process (nlohmann's values allocate
  // as they free themselves, which unwinding from bad_alloc does).
  if (text.size() > kMaxJsonBytes) {
    throw UserError(where + ": " + std::to_string(text.size()) + " bytes of JSON, more than the " +
                    std::to_string(kMaxJsonBytes >> 20) + " MiB any file fsdpp reads holds");
  }
  json value;
  try {
    value = json::parse(text.begin(), text.end(), bound);
  } catch (const json::exception& e) {  // a syntax error, or a number past double (406)
    throw UserError(where + ": not valid JSON (" + e.what() + ")");
  }
  if (too_deep) throw UserError(where + ": nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  if (!repeated_key.empty()) throw UserError(where + ": key \"" + repeated_key + "\" appears twice in one object");
  return value;
}

}  // namespace fsdpp
