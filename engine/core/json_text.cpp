// Parsing with the nesting bound: values past it are dropped as the parser meets them (so
// none is ever built), then the whole text is refused.
#include "core/json_text.h"

#include "core/error.h"

namespace fsdpp {

nlohmann::json parse_json(std::string_view text, const std::string& where) {
  using nlohmann::json;
  bool too_deep = false;
  const json::parser_callback_t bound = [&too_deep](int depth, json::parse_event_t event, json&) {
    const bool opens = event == json::parse_event_t::object_start || event == json::parse_event_t::array_start;
    if (opens && depth > kMaxJsonDepth) too_deep = true;
    return !too_deep;
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
  return value;
}

}  // namespace fsdpp
