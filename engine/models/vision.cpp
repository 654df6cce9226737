// Qwen2-VL's vision tower, step for step as transformers computes it (the same convolution,
// LayerNorms, per-frame SDPA and rotation), so features match to rounding.
#include "models/vision.h"

#include <ATen/ATen.h>

namespace fsdpp {

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
  t.copy_(at::normal(0.0, std, t.sizes(), gen, torch::TensorOptions().dtype(torch::kFloat32)));
}

PatchEmbed::PatchEmbed(const VisionConfig& c, const torch::TensorOptions& opts) : Module("PatchEmbed") {
  proj_ = register_child("proj", std::make_shared<PatchConv>(c, opts));
}

torch::Tensor PatchEmbed::forward(const torch::Tensor& patches) { return (*proj_)(patches); }

VisionAttention::VisionAttention(const VisionConfig& c, const torch::TensorOptions& opts)
    : Module("VisionAttention"), heads_(c.num_heads), head_dim_(c.embed_dim / c.num_heads) {
  qkv_ = register_child("qkv", std::make_shared<Linear>(c.embed_dim, 3 * c.embed_dim, true, opts));
  proj_ = register_child("proj", std::make_shared<Linear>(c.embed_dim, c.embed_dim, true, opts));
}

torch::Tensor VisionAttention::forward(const torch::Tensor& x, const torch::Tensor& cos_sin,
                                       const torch::Tensor& cu_seqlens) {
  const int64_t n = x.size(0);
  auto qkv = (*qkv_)(x).view({n, 3, heads_, head_dim_}).permute({1, 2, 0, 3});  // [3, H, N, D]
  auto q = apply_rotary(qkv[0], cos_sin).unsqueeze(0);                         // [1, H, N, D]
  auto k = apply_rotary(qkv[1], cos_sin).unsqueeze(0);
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

VisionBlock::VisionBlock(const VisionConfig& c, const torch::TensorOptions& opts) : Module("Qwen2VLVisionBlock") {
  norm1_ = register_child("norm1", std::make_shared<LayerNorm>(c.embed_dim, 1e-6, opts));
  norm2_ = register_child("norm2", std::make_shared<LayerNorm>(c.embed_dim, 1e-6, opts));
  attn_ = register_child("attn", std::make_shared<VisionAttention>(c, opts));
  mlp_ = register_child("mlp", std::make_shared<VisionMlp>(c, opts));
}

torch::Tensor VisionBlock::forward(const torch::Tensor& x, const torch::Tensor& cos_sin, const torch::Tensor& cu_seqlens) {
  auto h = x + (*attn_)((*norm1_)(x), cos_sin, cu_seqlens);
  return h + (*mlp_)((*norm2_)(h));
}

PatchMerger::PatchMerger(const VisionConfig& c, const torch::TensorOptions& opts)
    : Module("PatchMerger"), group_width_(c.embed_dim * c.spatial_merge_size * c.spatial_merge_size) {
  ln_q_ = register_child("ln_q", std::make_shared<LayerNorm>(c.embed_dim, 1e-6, opts));
  auto mlp = register_child("mlp", std::make_shared<Sequential>());
  fc1_ = mlp->add(0, std::make_shared<Linear>(group_width_, group_width_, true, opts));
  fc2_ = mlp->add(2, std::make_shared<Linear>(group_width_, c.out_hidden_size, true, opts));
}

torch::Tensor PatchMerger::forward(const torch::Tensor& x) {
  auto groups = (*ln_q_)(x).view({-1, group_width_});  // [N / m², m² E]
  return (*fc2_)(at::gelu((*fc1_)(groups)));
}

VisionTransformer::VisionTransformer(const VisionConfig& c, const torch::TensorOptions& opts)
    : Module("Qwen2VisionTransformerPretrainedModel"), config_(c) {
  const int64_t rotary_dim = c.embed_dim / c.num_heads / 2;  // half the head for rows, half for columns
  inv_freq_ = 1.0 / at::pow(10000.0, at::arange(0, rotary_dim, 2, at::kFloat) / static_cast<double>(rotary_dim));
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

torch::Tensor VisionTransformer::forward(const torch::Tensor& patches, const torch::Tensor& grid_thw) {
  auto h = (*patch_embed_)(patches);  // [N, E]
  auto cos_sin = rotary_tables(grid_thw).to(h.device());
  // Every frame is its own attention sequence of rows × columns patches.
  auto frame_sizes = at::repeat_interleave(grid_thw.select(1, 1) * grid_thw.select(1, 2), grid_thw.select(1, 0));
  auto cu_seqlens = at::cat({at::zeros({1}, at::kLong), frame_sizes.cumsum(0)});
  for (auto& block : blocks_) h = (*block)(h, cos_sin, cu_seqlens);
  return (*merger_)(h);
}

}  // namespace fsdpp
