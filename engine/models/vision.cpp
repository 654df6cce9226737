// The Qwen2-VL and Qwen2.5-VL vision towers, step for step as transformers computes them
// (the same convolution, norms, per-sequence SDPA, rotation and window order), so features
// match to rounding.
#include "models/elementwise.h"
#include "models/vision.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace fsdpp {

namespace {

std::string name_of(const VisionConfig& c, const std::string& qwen2, const std::string& qwen2_5) {
  return c.windowed ? qwen2_5 : qwen2;
}

// The SwiGLU of a Qwen2.5-VL block is the decoder's MLP at the tower's widths, with biases.
ModelConfig swiglu_widths(const VisionConfig& c) {
  ModelConfig widths;
  widths.hidden_size = c.embed_dim;
  widths.mlp_bias = true;
  return widths;
}

}  // namespace

PatchConv::PatchConv(const VisionConfig& c, const torch::TensorOptions& opts) : Module("Conv3d") {
  weight = register_parameter(
      "weight", new_parameter({c.embed_dim, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size}, opts));
}

torch::Tensor PatchConv::forward(const torch::Tensor& patches) {
  const auto k = weight.sizes();
  auto cubes = patches.to(weight.scalar_type()).view({-1, k[1], k[2], k[3], k[4]});  // [N, C, Tt, P, P]
  return at::conv3d(cubes, weight, /*bias=*/{}, /*stride=*/{k[2], k[3], k[4]}).view({-1, k[0]});
}

void PatchConv::init_parameter(const std::string&, torch::Tensor& t, at::Generator& gen, double std) {
  fill_normal(t, gen, std);
}

PatchEmbed::PatchEmbed(const VisionConfig& c, const torch::TensorOptions& opts)
    : Module(name_of(c, "PatchEmbed", "Qwen2_5_VisionPatchEmbed")) {
  proj_ = register_child("proj", std::make_shared<PatchConv>(c, opts));
}

torch::Tensor PatchEmbed::forward(const torch::Tensor& patches) { return (*proj_)(patches); }

VisionAttention::VisionAttention(const VisionConfig& c, const torch::TensorOptions& opts)
    : Module(name_of(c, "VisionAttention", "Qwen2_5_VLVisionAttention")),
      heads_(c.num_heads),
      head_dim_(c.embed_dim / c.num_heads) {
  qkv_ = register_child("qkv", std::make_shared<Linear>(c.embed_dim, 3 * c.embed_dim, true, opts));
  proj_ = register_child("proj", std::make_shared<Linear>(c.embed_dim, c.embed_dim, true, opts));
}

torch::Tensor VisionAttention::forward(const torch::Tensor& x, const torch::Tensor& cos_sin,
                                       const torch::Tensor& cu_seqlens) {
  const int64_t n = x.size(0);
  auto qkv = (*qkv_)(x).view({n, 3, heads_, head_dim_}).permute({1, 2, 0, 3});  // [3, H, N, D]
  const auto tables = widened_rotary_tables(cos_sin);
  auto q = apply_rotary(qkv[0], tables).unsqueeze(0);                          // [1, H, N, D]
  auto k = apply_rotary(qkv[1], tables).unsqueeze(0);
  auto v = qkv[2].unsqueeze(0);
  // Attention never crosses a frame: one SDPA per sequence of patches.
  std::vector<torch::Tensor> outs;
  auto bounds = cu_seqlens.accessor<int64_t, 1>();
  for (int64_t s = 0; s + 1 < cu_seqlens.size(0); ++s) {
    const int64_t begin = bounds[s], len = bounds[s + 1] - bounds[s];
    outs.push_back(at::scaled_dot_product_attention(q.narrow(2, begin, len), k.narrow(2, begin, len),
                                                    v.narrow(2, begin, len)));
  }
  auto out = at::cat(outs, 2).squeeze(0).transpose(0, 1).reshape({n, heads_ * head_dim_});  // [N, E]
  return (*proj_)(out);
}

VisionMlp::VisionMlp(const VisionConfig& c, const torch::TensorOptions& opts) : Module("VisionMlp") {
  fc1_ = register_child("fc1", std::make_shared<Linear>(c.embed_dim, c.intermediate_size, true, opts));
  fc2_ = register_child("fc2", std::make_shared<Linear>(c.intermediate_size, c.embed_dim, true, opts));
}

torch::Tensor VisionMlp::forward(const torch::Tensor& x) {
  auto h = (*fc1_)(x);
  return (*fc2_)(h * at::sigmoid(1.702 * h));  // quick GELU
}

VisionBlock::VisionBlock(const VisionConfig& c, const torch::TensorOptions& opts)
    : Module(name_of(c, "Qwen2VLVisionBlock", "Qwen2_5_VLVisionBlock")) {
  for (int i = 0; i < 2; ++i) {
    const std::string name = i == 0 ? "norm1" : "norm2";
    if (c.windowed) {
      rms_norm_[i] = register_child(name, std::make_shared<RMSNorm>("Qwen2RMSNorm", c.embed_dim, 1e-6, opts));
    } else {
      layer_norm_[i] = register_child(name, std::make_shared<LayerNorm>(c.embed_dim, 1e-6, opts));
    }
  }
  attn_ = register_child("attn", std::make_shared<VisionAttention>(c, opts));
  if (c.windowed) {
    swiglu_ = register_child("mlp", std::make_shared<MLP>(DecoderFamily{.prefix = "Qwen2_5_VL"}, swiglu_widths(c), c.intermediate_size, opts));
  } else {
    mlp_ = register_child("mlp", std::make_shared<VisionMlp>(c, opts));
  }
}

torch::Tensor VisionBlock::norm(int which, const torch::Tensor& x) {
  return layer_norm_[which] ? (*layer_norm_[which])(x) : (*rms_norm_[which])(x);
}

torch::Tensor VisionBlock::forward(const torch::Tensor& x, const torch::Tensor& cos_sin, const torch::Tensor& cu_seqlens) {
  auto h = x + (*attn_)(norm(0, x), cos_sin, cu_seqlens);
  return h + (mlp_ ? (*mlp_)(norm(1, h)) : (*swiglu_)(norm(1, h)));
}

PatchMerger::PatchMerger(const VisionConfig& c, const torch::TensorOptions& opts)
    : Module(name_of(c, "PatchMerger", "Qwen2_5_VLPatchMerger")),
      group_width_(c.embed_dim * c.spatial_merge_size * c.spatial_merge_size) {
  if (c.windowed) {
    rms_q_ = register_child("ln_q", std::make_shared<RMSNorm>("Qwen2RMSNorm", c.embed_dim, 1e-6, opts));
  } else {
    ln_q_ = register_child("ln_q", std::make_shared<LayerNorm>(c.embed_dim, 1e-6, opts));
  }
  auto mlp = register_child("mlp", std::make_shared<Sequential>());
  fc1_ = mlp->add(0, std::make_shared<Linear>(group_width_, group_width_, true, opts));
  fc2_ = mlp->add(2, std::make_shared<Linear>(group_width_, c.out_hidden_size, true, opts));
}

torch::Tensor PatchMerger::forward(const torch::Tensor& x) {
  auto groups = (ln_q_ ? (*ln_q_)(x) : (*rms_q_)(x)).view({-1, group_width_});  // [N / m², m² E]
  return (*fc2_)(at::gelu((*fc1_)(groups)));
}

VisionTransformer::VisionTransformer(const VisionConfig& c, const torch::TensorOptions& opts)
    : Module(name_of(c, "Qwen2VisionTransformerPretrainedModel", "Qwen2_5_VisionTransformerPretrainedModel")),
      config_(c) {
  const int64_t rotary_dim = c.embed_dim / c.num_heads / 2;  // half the head for rows, half for columns
  inv_freq_ = 1.0 / at::pow(c.rope_theta, at::arange(0, rotary_dim, 2, at::kFloat) / static_cast<double>(rotary_dim));
  patch_embed_ = register_child("patch_embed", std::make_shared<PatchEmbed>(c, opts));
  auto blocks = register_child("blocks", std::make_shared<ModuleList>());
  for (int64_t i = 0; i < c.depth; ++i) blocks_.push_back(blocks->append(std::make_shared<VisionBlock>(c, opts)));
  merger_ = register_child("merger", std::make_shared<PatchMerger>(c, opts));
}

torch::Tensor VisionTransformer::rotary_tables(const torch::Tensor& grid_thw) const {
  const int64_t m = config_.spatial_merge_size;
  std::vector<torch::Tensor> positions;
  auto grid = grid_thw.accessor<int64_t, 2>();
  int64_t largest = 0;
  for (int64_t i = 0; i < grid_thw.size(0); ++i) {
    const int64_t t = grid[i][0], h = grid[i][1], w = grid[i][2];
    largest = std::max({largest, h, w});
    // Patches come in merge-group order: (row group, column group, row in group, column in group).
    auto order = [&](const torch::Tensor& p) { return p.reshape({h / m, m, w / m, m}).permute({0, 2, 1, 3}).flatten(); };
    auto rows = order(at::arange(h, at::kLong).unsqueeze(1).expand({h, w}));
    auto cols = order(at::arange(w, at::kLong).unsqueeze(0).expand({h, w}));
    positions.push_back(at::stack({rows, cols}, -1).repeat({t, 1}));  // [t h w, 2]
  }
  auto freqs = at::outer(at::arange(largest, at::kFloat), inv_freq_);  // [G, D / 4]
  auto half = freqs.index({at::cat(positions)}).flatten(1);           // [N, D / 2]
  auto emb = at::cat({half, half}, -1);                                // [N, D]
  return at::stack({emb.cos(), emb.sin()});
}

std::pair<torch::Tensor, torch::Tensor> VisionTransformer::windows(const torch::Tensor& grid_thw) const {
  const int64_t m = config_.spatial_merge_size, span = config_.window_size / m / config_.patch_size;
  std::vector<torch::Tensor> order;
  std::vector<int64_t> bounds{0};
  int64_t first_group = 0;
  auto grid = grid_thw.accessor<int64_t, 2>();
  for (int64_t i = 0; i < grid_thw.size(0); ++i) {
    const int64_t t = grid[i][0], rows = grid[i][1] / m, cols = grid[i][2] / m;
    // Pad the group grid to whole windows, walk it window by window, drop the padding.
    const int64_t windows_h = rows / span + 1, windows_w = cols / span + 1;
    auto index = at::full({t, windows_h * span, windows_w * span}, -1, at::kLong);
    index.narrow(1, 0, rows).narrow(2, 0, cols).copy_(at::arange(t * rows * cols, at::kLong).view({t, rows, cols}));
    auto by_window = index.view({t, windows_h, span, windows_w, span}).permute({0, 1, 3, 2, 4}).reshape({-1, span * span});
    auto real = by_window >= 0;
    order.push_back(by_window.masked_select(real) + first_group);
    auto sizes = real.sum(1);  // groups per window, empty ones included
    for (int64_t w = 0; w < sizes.size(0); ++w) {
      const int64_t next = bounds.back() + sizes[w].item<int64_t>() * m * m;
      if (next != bounds.back()) bounds.push_back(next);
    }
    first_group += t * rows * cols;
  }
  return {at::cat(order), at::tensor(bounds, at::kLong)};
}

torch::Tensor VisionTransformer::forward(const torch::Tensor& patches, const torch::Tensor& grid_thw) {
  auto h = (*patch_embed_)(patches);  // [N, E]
  auto cos_sin = rotary_tables(grid_thw).to(h.device());
  // Every frame is its own attention sequence of rows × columns patches.
  auto frame_sizes = at::repeat_interleave(grid_thw.select(1, 1) * grid_thw.select(1, 2), grid_thw.select(1, 0));
  auto cu_seqlens = at::cat({at::zeros({1}, at::kLong), frame_sizes.cumsum(0)});
  if (!config_.windowed) {
    for (auto& block : blocks_) h = (*block)(h, cos_sin, cu_seqlens);
    return (*merger_)(h);
  }
  // Windows attend among their own merge groups: reorder the groups window by window,
  // run the blocks, and put the merged features back in the original order.
  const int64_t group = config_.spatial_merge_size * config_.spatial_merge_size, n = h.size(0);
  auto [order, window_bounds] = windows(grid_thw);
  h = h.view({n / group, group, -1}).index({order}).reshape({n, -1});
  cos_sin = cos_sin.view({2, n / group, group, -1}).index({at::indexing::Slice(), order}).reshape({2, n, -1});
  const auto& full = config_.fullatt_block_indexes;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const bool whole = std::find(full.begin(), full.end(), static_cast<int64_t>(i)) != full.end();
    h = (*blocks_[i])(h, cos_sin, whole ? cu_seqlens : window_bounds);
  }
  return (*merger_)(h).index({at::argsort(order)});
}

}  // namespace fsdpp
