// Multi-head latent attention over ATen's fused scaled_dot_product_attention, whose kernels
// take a value width other than the query/key width.
#include "models/latent_attention.h"

#include "models/document_attention.h"
#include "models/elementwise.h"

#include <ATen/ATen.h>

#include <cmath>

namespace fsdpp {

namespace {

// The rotated part as transformers' rope_interleave reads it: pairs (x0, x1), (x2, x3), ...
// rearranged to (x0, x2, ..., x1, x3, ...) before the usual half rotation.
torch::Tensor deinterleave(const torch::Tensor& x) {  // [..., D]
  return x.unflatten(-1, {x.size(-1) / 2, 2}).transpose(-1, -2).flatten(-2);
}

}  // namespace

LatentAttention::LatentAttention(const DecoderFamily& family, const ModelConfig& c, const torch::TensorOptions& opts)
    : SelfAttention(family.prefix + "Attention"), dims_(*c.latent_attention), heads_(c.num_attention_heads) {
  const int64_t qk_head = c.query_key_head_dim();
  scale_ = 1.0 / std::sqrt(static_cast<double>(qk_head)) * yarn_softmax_scale(c.rope_scaling);
  // transformers gives these two norms its default epsilon, not the config's.
  constexpr double kLatentNormEps = 1e-6;
  if (dims_.q_lora_rank == 0) {
    q_proj_ = register_child("q_proj", std::make_shared<Linear>(c.hidden_size, heads_ * qk_head, false, opts));
  } else {
    q_a_proj_ = register_child("q_a_proj", std::make_shared<Linear>(c.hidden_size, dims_.q_lora_rank, c.attention_bias, opts));
    q_a_layernorm_ = register_child("q_a_layernorm", std::make_shared<RMSNorm>(family.prefix + "RMSNorm", dims_.q_lora_rank,
                                                                               kLatentNormEps, opts));
    q_b_proj_ = register_child("q_b_proj", std::make_shared<Linear>(dims_.q_lora_rank, heads_ * qk_head, false, opts));
  }
  kv_a_proj_with_mqa_ = register_child(
      "kv_a_proj_with_mqa",
      std::make_shared<Linear>(c.hidden_size, dims_.kv_lora_rank + dims_.qk_rope_head_dim, c.attention_bias, opts));
  kv_a_layernorm_ = register_child("kv_a_layernorm", std::make_shared<RMSNorm>(family.prefix + "RMSNorm", dims_.kv_lora_rank,
                                                                               kLatentNormEps, opts));
  kv_b_proj_ = register_child("kv_b_proj", std::make_shared<Linear>(
                                               dims_.kv_lora_rank, heads_ * (dims_.qk_nope_head_dim + dims_.v_head_dim), false, opts));
  o_proj_ = register_child("o_proj", std::make_shared<Linear>(heads_ * dims_.v_head_dim, c.hidden_size, c.attention_bias, opts));
}

torch::Tensor LatentAttention::queries(const torch::Tensor& x) {
  const auto q = q_proj_ ? (*q_proj_)(x) : (*q_b_proj_)((*q_a_layernorm_)((*q_a_proj_)(x)));  // [B, T, H (nope + rope)]
  return q.view({x.size(0), x.size(1), heads_, -1}).transpose(1, 2);                        // [B, H, T, nope + rope]
}

torch::Tensor LatentAttention::forward(const torch::Tensor& x, const torch::Tensor& cos_sin,
                                       const torch::Tensor& scope) {
  const int64_t B = x.size(0), T = x.size(1);
  const int64_t nope = dims_.qk_nope_head_dim, rope = dims_.qk_rope_head_dim, v_dim = dims_.v_head_dim;
  auto q = queries(x);
  auto q_pass = q.narrow(-1, 0, nope), q_rot = q.narrow(-1, nope, rope);  // [B, H, T, nope], [B, H, T, rope]

  const auto compressed = (*kv_a_proj_with_mqa_)(x);  // [B, T, kv_lora_rank + rope]
  auto kv = (*kv_b_proj_)((*kv_a_layernorm_)(compressed.narrow(-1, 0, dims_.kv_lora_rank)))
                .view({B, T, heads_, nope + v_dim})
                .transpose(1, 2);                                         // [B, H, T, nope + v]
  auto k_pass = kv.narrow(-1, 0, nope), value = kv.narrow(-1, nope, v_dim);
  auto k_rot = compressed.narrow(-1, dims_.kv_lora_rank, rope).view({B, 1, T, rope});  // one for all heads

  if (dims_.rope_interleave) {
    q_rot = deinterleave(q_rot);
    k_rot = deinterleave(k_rot);
  }
  const auto tables = widened_rotary_tables(cos_sin);
  q_rot = apply_rotary(q_rot, tables);
  k_rot = apply_rotary(k_rot, tables).expand({B, heads_, T, rope});
  const auto query = at::cat({q_pass, q_rot}, -1);  // [B, H, T, nope + rope]
  const auto [key, values] = with_cached(at::cat({k_pass, k_rot}, -1), value);  // [B, H, cached + T, ...]
  auto out = scoped_attention(query, key, values, scope, scale_);  // [B, H, T, v]
  return (*o_proj_)(out.transpose(1, 2).reshape({B, T, heads_ * v_dim}));
}

}  // namespace fsdpp
