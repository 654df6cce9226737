// Parsing model.safetensors.index.json.
#include "io/weight_index.h"

#include "core/error.h"
#include "core/json_text.h"
#include "core/mapped_file.h"

#include <nlohmann/json.hpp>

namespace fsdpp {

std::map<std::string, std::string> parse_weight_map(const std::string& text, const std::string& where) {
  using nlohmann::json;
  const json j = parse_json(text, where);
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
    throw UserError(where + ": has no weight_map object");
  }
  std::map<std::string, std::string> files;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string()) throw UserError(where + ": weight_map['" + name + "'] is not a file name");
    const std::string& file_name = file.get_ref<const std::string&>();
    if (!is_plain_file_name(file_name)) {
      throw UserError(where + ": weight_map['" + name + "'] names a file '" + file_name +
                      "' outside the model directory (only plain file names are allowed)");
    }
    files.emplace(name, file_name);
  }
  return files;
}

}  // namespace fsdpp
