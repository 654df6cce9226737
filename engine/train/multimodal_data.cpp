// Reading multimodal samples and assembling a batch's rows and vision inputs.
#include "train/multimodal_data.h"

#include "core/error.h"
#include "core/mapped_file.h"
#include "io/safetensors.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <sstream>

namespace fsdpp {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

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

}  // namespace

MultimodalDataset MultimodalDataset::open(const fs::path& dir, const ModelConfig& model, int64_t seq_len) {
  if (!model.vision) {
    throw UserError(dir.string() + ": a multimodal dataset needs a vision-language model, not model_type '" +
                    model.model_type + "'");
  }
  MultimodalDataset d;
  d.dir_ = dir;
  d.seq_len_ = seq_len;
  d.image_token_ = model.image_token_id;
  d.video_token_ = model.video_token_id;
  d.pixels_ = SafetensorsFile::open(dir / "pixels.safetensors");
  const fs::path index = dir / "samples.jsonl";
  std::istringstream in(read_text_file(index));
  const int64_t merge = model.vision->spatial_merge_size;
  const int64_t patch_width = model.vision->in_channels * model.vision->temporal_patch_size *
                              model.vision->patch_size * model.vision->patch_size;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = index.string() + ":" + std::to_string(number);
    Sample sample;
    try {
      const json j = json::parse(line);
      sample.input_ids = integer_list(j.at("input_ids"), where + ": input_ids");
      for (const char* kind : {"images", "videos"}) {
        for (const auto& v : j.value(kind, json::array())) {
          Visual visual{v.at("pixels").get<std::string>(), integer_list(v.at("grid"), where + ": grid"),
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
    const auto count = [&](int64_t token) { return std::count(sample.input_ids.begin(), sample.input_ids.end(), token); };
    for (auto [kind, visuals, token] : {std::tuple{"image", &sample.images, d.image_token_},
                                        {"video", &sample.videos, d.video_token_}}) {
      int64_t expected = 0;
      for (const auto& v : *visuals) {
        const bool sized = v.grid.size() == 3 && std::all_of(v.grid.begin(), v.grid.end(), [](int64_t g) {
          return g >= 1 && g <= (int64_t{1} << 16);
        });
        if (!sized || v.grid[1] % merge != 0 || v.grid[2] % merge != 0) {
          throw UserError(where + ": " + kind + " grid must be [t, h, w] of sizes in [1, 65536], h and w multiples of " +
                          std::to_string(merge));
        }
        if (!d.pixels_->contains(v.pixels)) throw UserError(where + ": pixels.safetensors has no '" + v.pixels + "'");
        const auto& shape = d.pixels_->entries().at(v.pixels).shape;
        const int64_t patches = v.grid[0] * v.grid[1] * v.grid[2];
        if (shape != std::vector<int64_t>{patches, patch_width}) {
          throw UserError(where + ": pixels '" + v.pixels + "' should be [" + std::to_string(patches) + ", " +
                          std::to_string(patch_width) + "] for grid " + json(v.grid).dump());
        }
        expected += patches / (merge * merge);
      }
      if (count(token) != expected) {
        throw UserError(where + ": " + std::to_string(count(token)) + " " + kind + " placeholders, but the grids give " +
                        std::to_string(expected));
      }
    }
    if (static_cast<int64_t>(sample.input_ids.size()) > seq_len + 1 || sample.input_ids.size() < 2) {
      throw UserError(where + ": " + std::to_string(sample.input_ids.size()) + " tokens; a sample needs 2 to data.seq_len + 1 = " +
                      std::to_string(seq_len + 1));
    }
    for (int64_t id : sample.input_ids) {
      if (id < 0 || id >= model.vocab_size) {
        throw UserError(where + ": token " + std::to_string(id) + " is outside the vocabulary of " +
                        std::to_string(model.vocab_size));
      }
    }
    sample.target_count = (d.targets(sample) != -100).sum().item<int64_t>();
    d.samples_.push_back(std::move(sample));
  }
  if (d.samples_.empty()) throw UserError(index.string() + ": no samples");
  return d;
}

at::Tensor MultimodalDataset::targets(const Sample& sample) const {
  auto target = at::full({seq_len_}, -100, at::kLong);
  for (size_t i = 1; i < sample.input_ids.size(); ++i) {
    const int64_t next = sample.input_ids[i];
    if (next != image_token_ && next != video_token_) target[static_cast<int64_t>(i) - 1] = next;
  }
  return target;
}

int64_t MultimodalDataset::target_count(const std::vector<int64_t>& samples) const {
  int64_t n = 0;
  for (int64_t s : samples) n += samples_[static_cast<size_t>(s)].target_count;
  return n;
}

MultimodalBatch MultimodalDataset::batch(const std::vector<int64_t>& samples) const {
  std::vector<at::Tensor> inputs, targets_, image_pixels, image_grids, video_pixels, video_grids, seconds;
  for (int64_t s : samples) {
    const Sample& sample = samples_[static_cast<size_t>(s)];
    auto input = at::zeros({seq_len_}, at::kLong);  // short samples are padded with token 0, never predicted
    const auto n = std::min<int64_t>(seq_len_, static_cast<int64_t>(sample.input_ids.size()));
    input.narrow(0, 0, n).copy_(at::tensor(std::vector<int64_t>(sample.input_ids.begin(), sample.input_ids.begin() + n)));
    inputs.push_back(input);
    targets_.push_back(targets(sample));
    for (const auto& v : sample.images) {
      image_pixels.push_back(pixels_->tensor(v.pixels).to(at::kFloat));
      image_grids.push_back(at::tensor(v.grid, at::kLong));
    }
    for (const auto& v : sample.videos) {
      video_pixels.push_back(pixels_->tensor(v.pixels).to(at::kFloat));
      video_grids.push_back(at::tensor(v.grid, at::kLong));
      seconds.push_back(at::full({1}, v.seconds, at::kDouble));
    }
  }
  MultimodalBatch b{at::stack(inputs), at::stack(targets_), {}};
  if (!image_pixels.empty()) b.vision.pixel_values = at::cat(image_pixels), b.vision.image_grid_thw = at::stack(image_grids);
  if (!video_pixels.empty()) {
    b.vision.pixel_values_videos = at::cat(video_pixels);
    b.vision.video_grid_thw = at::stack(video_grids);
    b.vision.second_per_grid_ts = at::cat(seconds);
  }
  return b;
}

}  // namespace fsdpp
