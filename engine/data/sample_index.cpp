// Parsing and validating samples.jsonl.
#include "data/sample_index.h"

#include "core/error.h"
#include "core/json_text.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>
#include <tuple>

namespace fsdpp {

namespace {

using nlohmann::json;

// A list of JSON integers: 1.5 is refused rather than read as 1.
std::vector<int64_t> integer_list(const json& list, const std::string& what) {
  if (!list.is_array()) throw UserError(what + " must be a list of integers");
  std::vector<int64_t> out;
  for (const json& v : list) {
    if (!v.is_number_integer()) throw UserError(what + " must hold integers, not " + v.dump());
    out.push_back(v.get<int64_t>());
  }
  return out;
}

// The fields of one line, typed; nothing checked against the model yet.
SampleRecord read_sample(const std::string& line, const std::string& where) {
  SampleRecord sample;
  try {
    const json j = parse_json(line, where);
    sample.input_ids = integer_list(j.at("input_ids"), where + ": input_ids");
    if (j.contains("prompt_length")) {
      if (!j["prompt_length"].is_number_integer()) throw UserError(where + ": prompt_length must be an integer");
      sample.prompt_length = j["prompt_length"].get<int64_t>();
    }
    for (const char* kind : {"images", "videos"}) {
      for (const auto& v : j.value(kind, json::array())) {
        VisualRecord visual{v.at("pixels").get<std::string>(), integer_list(v.at("grid"), where + ": grid"),
                            v.value("seconds_per_grid", 1.0)};
        if (!std::isfinite(visual.seconds) || visual.seconds <= 0) {
          throw UserError(where + ": seconds_per_grid must be a positive number");
        }
        (kind[0] == 'i' ? sample.images : sample.videos).push_back(std::move(visual));
      }
    }
  } catch (const json::exception& e) {
    throw UserError(where + ": not a sample (" + std::string(e.what()) + ")");
  }
  return sample;
}

// The lengths of the runs of `token` in `ids`, in order.
std::vector<int64_t> runs_of(const std::vector<int64_t>& ids, int64_t token) {
  std::vector<int64_t> runs;
  for (size_t at = 0; at < ids.size(); ++at) {
    if (ids[at] != token) continue;
    if (at == 0 || ids[at - 1] != token) runs.push_back(0);
    ++runs.back();
  }
  return runs;
}

// "[72, 36]".
std::string list_text(const std::vector<int64_t>& values) { return json(values).dump(); }

// Each image's or video's grid and pixels, and its own run of as many placeholder tokens as
// its grid gives, in the order the images (videos) are listed: the model fills each run with
// one image's merged patches.
void check_visuals(const SampleRecord& sample, const std::string& where, const ModelConfig& model,
                   const std::map<std::string, SafetensorsEntry>& pixels) {
  const VisionConfig& vision = *model.vision;
  const int64_t merge = vision.spatial_merge_size;
  const int64_t patch_width = vision.in_channels * vision.temporal_patch_size * vision.patch_size * vision.patch_size;
  for (auto [kind, visuals, token] : {std::tuple{"image", &sample.images, model.image_token_id},
                                      {"video", &sample.videos, model.video_token_id}}) {
    std::vector<int64_t> wanted;  // each one's placeholders
    for (const auto& v : *visuals) {
      const bool sized = v.grid.size() == 3 && std::all_of(v.grid.begin(), v.grid.end(), [](int64_t g) {
        return g >= 1 && g <= (int64_t{1} << 16);
      });
      if (!sized || v.grid[1] % merge != 0 || v.grid[2] % merge != 0) {
        throw UserError(where + ": " + kind + " grid must be [t, h, w] of sizes in [1, 65536], h and w multiples of " +
                        std::to_string(merge));
      }
      const auto found = pixels.find(v.pixels);
      if (found == pixels.end()) throw UserError(where + ": pixels.safetensors has no '" + v.pixels + "'");
      const int64_t patches = v.grid[0] * v.grid[1] * v.grid[2];
      if (found->second.shape != std::vector<int64_t>{patches, patch_width}) {
        throw UserError(where + ": pixels '" + v.pixels + "' should be [" + std::to_string(patches) + ", " +
                        std::to_string(patch_width) + "] for grid " + json(v.grid).dump());
      }
      wanted.push_back(patches / (merge * merge));
    }
    const std::vector<int64_t> runs = runs_of(sample.input_ids, token);
    const int64_t count = std::accumulate(runs.begin(), runs.end(), int64_t{0});
    const int64_t expected = std::accumulate(wanted.begin(), wanted.end(), int64_t{0});
    if (count != expected) {
      throw UserError(where + ": " + std::to_string(count) + " " + kind + " placeholders, but the grids give " +
                      std::to_string(expected));
    }
    if (runs != wanted) {
      throw UserError(where + ": the " + kind + " placeholders lie in runs of " + list_text(runs) + " tokens, but the " +
                      kind + "s' grids give " + list_text(wanted) + ": one run each, in their order");
    }
  }
}

}  // namespace

std::vector<SampleRecord> parse_samples(const std::string& text, const std::string& where, const ModelConfig& model,
                                        int64_t seq_len, const std::map<std::string, SafetensorsEntry>& pixels) {
  std::vector<SampleRecord> samples;
  std::istringstream in(text);
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string line_where = where + ":" + std::to_string(number);
    SampleRecord sample = read_sample(line, line_where);
    check_visuals(sample, line_where, model, pixels);
    if (static_cast<int64_t>(sample.input_ids.size()) > seq_len + 1 || sample.input_ids.size() < 2) {
      throw UserError(line_where + ": " + std::to_string(sample.input_ids.size()) +
                      " tokens; a sample needs 2 to data.seq_len + 1 = " + std::to_string(seq_len + 1));
    }
    // A sample of seq_len + 1 tokens feeds the first seq_len; its last is a target alone, so
    // a placeholder there would leave its image one merged patch short in the model.
    const int64_t last = sample.input_ids.back();
    if (static_cast<int64_t>(sample.input_ids.size()) == seq_len + 1 &&
        (last == model.image_token_id || last == model.video_token_id)) {
      throw UserError(line_where + ": its last token, the data.seq_len + 1 = " + std::to_string(seq_len + 1) +
                      "th, is a placeholder, which only an input can hold; end the sample in text or shorten it");
    }
    for (int64_t id : sample.input_ids) {
      if (id < 0 || id >= model.vocab_size) {
        throw UserError(line_where + ": token " + std::to_string(id) + " is outside the vocabulary of " +
                        std::to_string(model.vocab_size));
      }
    }
    const auto size = static_cast<int64_t>(sample.input_ids.size());
    if (sample.prompt_length < 0 || sample.prompt_length >= size) {
      throw UserError(line_where + ": prompt_length " + std::to_string(sample.prompt_length) + " of " +
                      std::to_string(size) + " tokens; it must be in [0, " + std::to_string(size - 1) +
                      "], leaving the completion a token at least");
    }
    auto targets_from = [&](int64_t first) {
      return std::count_if(sample.input_ids.begin() + first, sample.input_ids.end(), [&](int64_t id) {
        return id != model.image_token_id && id != model.video_token_id;
      });
    };
    sample.target_count = targets_from(1);
    sample.completion_target_count = targets_from(std::max<int64_t>(1, sample.prompt_length));
    samples.push_back(std::move(sample));
  }
  if (samples.empty()) throw UserError(where + ": no samples");
  return samples;
}

}  // namespace fsdpp
