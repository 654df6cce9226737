// The index of a Hugging Face checkpoint sharded over several safetensors files
// (model.safetensors.index.json): which file of the directory holds each tensor. Parsed
// from its text alone; opening the files is HfWeights's.
#pragma once

#include <map>
#include <string>

namespace fsdpp {

// The weight_map, tensor name -> file name. UserError starting with `where` for text that
// is not a JSON object with a weight_map object, a file name that is not a string, or one
// that is not a plain name inside the directory.
std::map<std::string, std::string> parse_weight_map(const std::string& text, const std::string& where);

}  // namespace fsdpp
