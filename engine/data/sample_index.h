// samples.jsonl of a multimodal dataset (data/multimodal_data.h gives the layout), parsed
// and validated from its text, the model's config and the pixel file's header alone, so the
// parser can be fuzzed without the rest of the engine.
#pragma once

#include "io/safetensors_header.h"
#include "models/model_config.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdpp {

struct VisualRecord {
  std::string pixels;         // key in pixels.safetensors
  std::vector<int64_t> grid;  // t, h, w
  double seconds = 1.0;       // videos: seconds per temporal grid step
};

struct SampleRecord {
  std::vector<int64_t> input_ids;
  std::vector<VisualRecord> images, videos;
  int64_t prompt_length = 0;  // its first tokens that are a prompt: no target under train_on = "completion"
  // Tokens it asks to be predicted, none a placeholder: those after the first, and those past the prompt.
  int64_t target_count = 0, completion_target_count = 0;
};

// Every non-blank line of `text` as a sample for `model` (which has a vision tower) and
// windows of seq_len + 1 tokens, its pixels found among `pixels`. UserError naming
// `where`:line for a line that is not such a sample: not JSON, a non-integer id or grid, a
// grid out of range or not a multiple of the merge size, a missing or misshapen pixel key, a
// placeholder count its grids do not give, a length outside [2, seq_len + 1], a placeholder
// as the last of seq_len + 1 tokens (which is no input), a token outside the vocabulary, a
// prompt_length that leaves no token after the prompt; and for a file without samples.
std::vector<SampleRecord> parse_samples(const std::string& text, const std::string& where, const ModelConfig& model,
                                        int64_t seq_len, const std::map<std::string, SafetensorsEntry>& pixels);

}  // namespace fsdpp
