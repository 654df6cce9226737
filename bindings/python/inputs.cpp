// Checking the tensors a Python loop hands the run, each refusal one line naming the argument.
#include "bindings/python/inputs.h"

#include "core/error.h"
#include "models/multimodal_positions.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <sstream>

namespace fsdpp {

namespace {

std::string type_and_shape(const at::Tensor& t) {
  return std::string(c10::toString(t.scalar_type())) + " " + shape_text(t);
}

at::Tensor checked_offsets(const at::Tensor& offsets, const at::Tensor& ids) {
  const at::Tensor host = offsets.to(at::kCPU);
  if (host.dim() != 1 || host.scalar_type() != at::kLong || host.numel() < 2) {
    throw UserError("document_offsets: expected a [documents + 1] int64 tensor, got " + type_and_shape(host));
  }
  const bool rising = (host.slice(0, 1) > host.slice(0, 0, -1)).all().item<bool>();
  if (host[0].item<int64_t>() != 0 || host[-1].item<int64_t>() != ids.numel() || !rising) {
    throw UserError("document_offsets: must rise from 0 to the " + std::to_string(ids.numel()) +
                    " tokens of input_ids " + shape_text(ids));
  }
  // Attention stays within a row: a document ends at each row's end.
  const at::Tensor contiguous = host.contiguous();
  const int64_t* begin = contiguous.data_ptr<int64_t>();
  const int64_t* end = begin + contiguous.numel();
  const int64_t tokens = ids.size(1);
  for (int64_t row = 1; row < ids.size(0); ++row) {
    if (!std::binary_search(begin, end, row * tokens)) {
      throw UserError("document_offsets: a document spans rows " + std::to_string(row - 1) + " and " +
                      std::to_string(row) + ": no offset is " + std::to_string(row * tokens) + ", where row " +
                      std::to_string(row) + " of " + std::to_string(tokens) + " tokens starts");
    }
  }
  return host;
}

}  // namespace

std::string shape_text(const at::Tensor& t) {
  std::string text = "[";
  for (int64_t d = 0; d < t.dim(); ++d) text += (d ? ", " : "") + std::to_string(t.size(d));
  return text + "]";
}

void check_token_ids(const std::string& what, const at::Tensor& ids, int64_t vocab) {
  if (ids.dim() != 2 || ids.scalar_type() != at::kLong) {
    throw UserError(what + ": expected a [batch, tokens] int64 tensor, got " + type_and_shape(ids));
  }
  if (ids.numel() == 0) throw UserError(what + ": empty " + shape_text(ids));
  const at::Tensor range = at::stack({ids.min(), ids.max()}).cpu();  // one wait for the device
  const int64_t low = range[0].item<int64_t>(), high = range[1].item<int64_t>();
  if (low < 0 || high >= vocab) {
    throw UserError(what + ": token ids must be in [0, " + std::to_string(vocab) + "), got " +
                    std::to_string(low < 0 ? low : high));
  }
}

void check_logprobs_inputs(const at::Tensor& input_ids, const at::Tensor& targets, double temperature, int64_t vocab) {
  check_token_ids("input_ids", input_ids, vocab);
  check_token_ids("targets", targets, vocab);
  if (targets.sizes() != input_ids.sizes()) {
    throw UserError("targets: expected the shape of input_ids " + shape_text(input_ids) + ", got " + shape_text(targets));
  }
  // Past these the logits / temperature overflow or flatten, and the log-probabilities are NaN or 0.
  if (!(temperature >= 1e-6 && temperature <= 1e6)) {
    std::ostringstream given;
    given << temperature;
    throw UserError("temperature: must be a positive number in [1e-06, 1e+06], got " + given.str());
  }
}

RowLayout checked_layout(const at::Tensor& ids, const std::optional<at::Tensor>& position_ids,
                         const std::optional<at::Tensor>& document_offsets) {
  RowLayout layout;
  if (document_offsets) layout.offsets = checked_offsets(*document_offsets, ids);
  if (position_ids) {
    const at::Tensor& positions = *position_ids;
    if (positions.sizes() != ids.sizes() || positions.scalar_type() != at::kLong) {
      throw UserError("position_ids: expected an int64 tensor shaped as input_ids " + shape_text(ids) + ", got " +
                      type_and_shape(positions));
    }
    const int64_t lowest = positions.min().item<int64_t>();
    if (lowest < 0) throw UserError("position_ids: positions must be >= 0, got " + std::to_string(lowest));
    layout.positions = positions;
  }
  return layout;
}

namespace {

// One kind's patches [N, width] and grids [count, 3] int64: both or neither, the patches as
// many as the grids' frames × rows × columns, each grid's sides whole merge groups.
void check_patches(const std::string& patches_name, const at::Tensor& patches, const std::string& grid_name,
                   const at::Tensor& grid, const VisionConfig& tower) {
  if (patches.defined() != grid.defined()) {
    throw UserError((patches.defined() ? grid_name : patches_name) + ": missing, where " +
                    (patches.defined() ? patches_name : grid_name) + " is given");
  }
  if (!patches.defined()) return;
  const int64_t width = tower.in_channels * tower.temporal_patch_size * tower.patch_size * tower.patch_size;
  if (patches.dim() != 2 || !at::isFloatingType(patches.scalar_type()) || patches.size(1) != width) {
    throw UserError(patches_name + ": expected a floating [patches, " + std::to_string(width) + "] tensor (" +
                    std::to_string(tower.in_channels) + " channels x " + std::to_string(tower.temporal_patch_size) +
                    " frames x " + std::to_string(tower.patch_size) + "^2 pixels a patch), got " + type_and_shape(patches));
  }
  if (grid.dim() != 2 || grid.size(1) != 3 || grid.scalar_type() != at::kLong || grid.size(0) == 0) {
    throw UserError(grid_name + ": expected an integer [count, 3] tensor of (frames, rows, columns), got " +
                    type_and_shape(grid));
  }
  const int64_t merge = tower.spatial_merge_size;
  const bool whole = (grid.select(1, 0) > 0).all().item<bool>() && (grid.narrow(1, 1, 2) > 0).all().item<bool>() &&
                     (grid.narrow(1, 1, 2) % merge == 0).all().item<bool>();
  if (!whole) {
    throw UserError(grid_name + ": every frame count must be positive and every row and column count a positive "
                    "multiple of the merge size " + std::to_string(merge));
  }
  const int64_t counted = grid.prod(1).sum().item<int64_t>();
  if (patches.size(0) != counted) {
    throw UserError(patches_name + ": " + std::to_string(patches.size(0)) + " patches, where " + grid_name +
                    " gives " + std::to_string(counted));
  }
}

}  // namespace

VisionInputs checked_vision(const ModelConfig& model, const at::Tensor& ids, const RowLayout& layout,
                            const std::map<std::string, at::Tensor>& given) {
  VisionInputs vision;
  at::Tensor token_types;
  for (const auto& [name, tensor] : given) {
    if (name == "mm_token_type_ids") {
      token_types = tensor.to(at::kCPU);
      continue;
    }
    at::Tensor* slot = name == "pixel_values"          ? &vision.pixel_values
                       : name == "image_grid_thw"      ? &vision.image_grid_thw
                       : name == "pixel_values_videos" ? &vision.pixel_values_videos
                       : name == "video_grid_thw"      ? &vision.video_grid_thw
                       : name == "second_per_grid_ts"  ? &vision.second_per_grid_ts
                                                       : nullptr;
    if (slot == nullptr) throw UserError(name + ": not an input of a vision-language model");
    // Grids and timings are read on the host, where positions are planned; grids of any integer
    // dtype (a processor's int32 among them) are counted in int64.
    const bool grid = name == "image_grid_thw" || name == "video_grid_thw";
    const bool integral = at::isIntegralType(tensor.scalar_type(), /*includeBool=*/false);
    *slot = name == "pixel_values" || name == "pixel_values_videos" ? tensor
            : grid && integral                                     ? tensor.to(at::kCPU, at::kLong)
                                                                   : tensor.to(at::kCPU);
  }
  if (!model.vision) {
    if (!given.empty()) {
      throw UserError(given.begin()->first + ": " + model.model_type + " takes no images or videos");
    }
    return vision;
  }
  if (layout.positions.defined()) {
    throw UserError("position_ids: " + model.model_type + " places its tokens itself (multimodal RoPE positions from "
                    "the images' grids): give none");
  }
  check_patches("pixel_values", vision.pixel_values, "image_grid_thw", vision.image_grid_thw, *model.vision);
  check_patches("pixel_values_videos", vision.pixel_values_videos, "video_grid_thw", vision.video_grid_thw,
                *model.vision);
  if (const at::Tensor& seconds = vision.second_per_grid_ts; seconds.defined()) {
    const int64_t videos = vision.video_grid_thw.defined() ? vision.video_grid_thw.size(0) : 0;
    if (seconds.dim() != 1 || seconds.size(0) != videos || !at::isFloatingType(seconds.scalar_type()) ||
        !((seconds >= 0) & (seconds <= 1e6)).all().item<bool>()) {
      throw UserError("second_per_grid_ts: expected a floating [" + std::to_string(videos) + "] tensor of seconds in "
                      "[0, 1e6], one per video, got " + type_and_shape(seconds));
    }
  }
  multimodal_positions(model, ids, vision, layout.offsets);  // the rows' placeholders against the grids
  // The processor's token types say again what the placeholders say: the check that they agree.
  if (token_types.defined()) {
    const at::Tensor host_ids = ids.to(at::kCPU);
    const at::Tensor expected = (host_ids == model.image_token_id).to(at::kLong) +
                                2 * (host_ids == model.video_token_id).to(at::kLong);  // [B, T]: 0 text, 1 image, 2 video
    if (token_types.sizes() != ids.sizes() || at::isFloatingType(token_types.scalar_type()) ||
        token_types.scalar_type() == at::kBool || !token_types.to(at::kLong).equal(expected)) {
      throw UserError("mm_token_type_ids: expected input_ids' shape " + shape_text(ids) + " with 1 at each image "
                      "placeholder (token " + std::to_string(model.image_token_id) + "), 2 at each video placeholder (" +
                      std::to_string(model.video_token_id) + ") and 0 elsewhere, got " + type_and_shape(token_types) +
                      " that differs");
    }
  }
  return vision;
}

at::Tensor checked_generation(const at::Tensor& ids, const std::optional<at::Tensor>& attention_mask,
                              const GenerationOptions& options, int64_t vocab,
                              const std::map<std::string, std::string>& names) {
  const auto name = [&names](const std::string& option) {
    const auto found = names.find(option);
    return found == names.end() ? option : found->second;
  };
  check_token_ids("input_ids", ids, vocab);
  if (options.max_new_tokens < 1 || options.max_new_tokens > 1'000'000) {
    throw UserError("max_new_tokens: must be in [1, 1000000], got " + std::to_string(options.max_new_tokens));
  }
  if (!(options.temperature >= 0.0 && options.temperature <= 1e6) ||
      (options.temperature > 0.0 && options.temperature < 1e-6)) {
    std::ostringstream given;
    given << options.temperature;
    throw UserError(name("temperature") + ": must be 0 (the most likely token) or in [1e-06, 1e+06], got " + given.str());
  }
  if (options.top_k < 0) {
    throw UserError(name("top_k") + ": must be >= 0 (0: every token), got " + std::to_string(options.top_k));
  }
  if (!(options.top_p > 0.0 && options.top_p <= 1.0)) {
    std::ostringstream given;
    given << options.top_p;
    throw UserError(name("top_p") + ": must be in (0, 1], got " + given.str());
  }
  std::vector<std::pair<const char*, int64_t>> tokens{{"pad_token_id", options.pad}};
  for (const int64_t id : options.eos) tokens.emplace_back("eos_token_id", id);
  for (const auto& [option, id] : tokens) {
    if (id < 0 || id >= vocab) {
      throw UserError(name(option) + ": must be a token in [0, " + std::to_string(vocab) + "), got " + std::to_string(id));
    }
  }
  if (!attention_mask) return {};
  const at::Tensor mask = attention_mask->to(at::kCPU);
  if (mask.sizes() != ids.sizes() || at::isFloatingType(mask.scalar_type()) || at::isComplexType(mask.scalar_type()) ||
      !((mask == 0) | (mask == 1)).all().item<bool>()) {
    throw UserError("attention_mask: expected 1 for a token and 0 for padding, shaped as input_ids " + shape_text(ids) +
                    ", got " + type_and_shape(mask));
  }
  const at::Tensor kept = mask.to(at::kBool);
  // Left padding alone: a row's tokens run to its end, so each new token follows its prompt.
  const at::Tensor starts_after_token = kept.narrow(1, 0, kept.size(1) - 1) & ~kept.narrow(1, 1, kept.size(1) - 1);
  const at::Tensor bad = starts_after_token.any(1) | ~kept.any(1);  // [B]
  if (bad.any().item<bool>()) {
    const int64_t row = bad.nonzero()[0][0].item<int64_t>();
    throw UserError("attention_mask: row " + std::to_string(row) + " is not padded on the left alone, or holds no "
                    "token: a generation continues each row from its last token");
  }
  return kept;
}

}  // namespace fsdpp
