// Multimodal RoPE positions, one row and one vision block at a time.
#include "models/multimodal_positions.h"

#include "core/error.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <string>
#include <vector>

namespace fsdpp {

namespace {

// The images' or the videos' grids [N, 3] as read on the host (none where undefined).
struct Grids {
  std::vector<std::array<int64_t, 3>> thw;  // frames, rows, columns of patches
  explicit Grids(const at::Tensor& grid) {
    if (!grid.defined()) return;
    const at::Tensor host = grid.to(at::kCPU, at::kLong).contiguous().view({-1, 3});
    const auto g = host.accessor<int64_t, 2>();
    for (int64_t i = 0; i < host.size(0); ++i) thw.push_back({g[i][0], g[i][1], g[i][2]});
  }
};

// The flat offsets where documents start (row starts among them), as a sorted list.
std::vector<int64_t> document_starts(const at::Tensor& documents, int64_t B, int64_t T) {
  std::vector<int64_t> starts;
  if (documents.defined()) {
    const at::Tensor host = documents.to(at::kCPU, at::kLong).contiguous();
    starts.assign(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
  }
  for (int64_t b = 0; b < B; ++b) starts.push_back(b * T);
  std::sort(starts.begin(), starts.end());
  return starts;
}

}  // namespace

at::Tensor multimodal_positions(const ModelConfig& config, const at::Tensor& input_ids, const VisionInputs& vision,
                                const at::Tensor& documents) {
  TORCH_CHECK(config.vision, config.model_type, " has no vision_config");
  const VisionConfig& tower = *config.vision;
  const int64_t B = input_ids.size(0), T = input_ids.size(1), merge = tower.spatial_merge_size;
  const at::Tensor ids = input_ids.to(at::kCPU, at::kLong).contiguous();  // read element by element
  const auto id = ids.accessor<int64_t, 2>();
  const std::vector<int64_t> starts = document_starts(documents, B, T);
  const Grids images(vision.image_grid_thw), videos(vision.video_grid_thw);
  const at::Tensor seconds = vision.second_per_grid_ts.defined() ? vision.second_per_grid_ts.to(at::kCPU, at::kFloat)
                                                                   : at::Tensor();
  auto out = at::empty({3, B, T}, at::kLong);
  auto pos = out.accessor<int64_t, 3>();
  size_t used_images = 0, used_videos = 0;
  int64_t next = 0;  // the position the next text token takes
  for (int64_t flat = 0; flat < B * T;) {
    const int64_t b = flat / T, t = flat % T;
    if (std::binary_search(starts.begin(), starts.end(), flat)) next = 0;
    const bool image = id[b][t] == config.image_token_id, video = id[b][t] == config.video_token_id;
    if (!image && !video) {
      for (int a = 0; a < 3; ++a) pos[a][b][t] = next;
      ++next, ++flat;
      continue;
    }
    const char* kind = image ? "image" : "video";
    const Grids& grids = image ? images : videos;
    size_t& index = image ? used_images : used_videos;
    if (index >= grids.thw.size()) {
      throw UserError(std::string("input_ids: row ") + std::to_string(b) + " holds " + kind + " placeholders at token " +
                      std::to_string(t) + " past the " + std::to_string(grids.thw.size()) + " " + kind +
                      "s the grids give");
    }
    const auto [frames, grid_rows, grid_cols] = grids.thw[index];
    const int64_t rows = grid_rows / merge, cols = grid_cols / merge, length = frames * rows * cols;
    // The block is the run of placeholders from here, as transformers 5 groups them: the grid's
    // count of them, in one row and one document.
    int64_t run = 0;
    while (t + run < T && id[b][t + run] == id[b][t]) ++run;
    const auto crossed = std::upper_bound(starts.begin(), starts.end(), flat);
    if (run != length || (crossed != starts.end() && *crossed < flat + length)) {
      throw UserError(std::string("input_ids: ") + kind + " " + std::to_string(index) + "'s grid [" +
                      std::to_string(frames) + ", " + std::to_string(grid_rows) + ", " + std::to_string(grid_cols) +
                      "] gives " + std::to_string(length) + " placeholders, and row " + std::to_string(b) +
                      " holds a run of " + std::to_string(run) + " from token " + std::to_string(t) +
                      (run == length ? " that crosses a document's start" : ""));
    }
    // A video's frame f sits at f × tokens_per_second × its seconds per temporal patch
    // (Qwen2.5-VL; 1 second where none is given), in float32 and truncated, as transformers
    // computes it; Qwen2-VL's frames and every image step by 1.
    float frame_step = 1.0F;
    if (video && tower.windowed) {
      const float given = seconds.defined() ? seconds[static_cast<int64_t>(index)].item<float>() : 1.0F;
      frame_step = static_cast<float>(tower.tokens_per_second) * given;
    }
    ++index;
    for (int64_t f = 0, at_t = t; f < frames; ++f) {
      const auto frame = static_cast<int64_t>(static_cast<float>(f) * frame_step);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c, ++at_t) {
          pos[0][b][at_t] = next + frame, pos[1][b][at_t] = next + r, pos[2][b][at_t] = next + c;
        }
      }
    }
    // Text resumes past the block's rows and columns, whatever its frames span: transformers
    // 5's placement (4.x resumed past the largest position, a long video's frames included).
    next += std::max(rows, cols);
    flat += length;
  }
  for (const auto& [kind, used, given] : {std::tuple{"image", used_images, images.thw.size()},
                                          {"video", used_videos, videos.thw.size()}}) {
    if (used != given) {
      throw UserError(std::string("input_ids: the grids give ") + std::to_string(given) + " " + kind + "s and the rows " +
                      "hold " + std::to_string(used) + " runs of their placeholders");
    }
  }
  return out;
}

}  // namespace fsdpp
