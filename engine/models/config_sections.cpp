// Reading the sections of a config.json: RoPE scaling, vision tower, experts, latent attention.
#include "models/config_sections.h"

#include "models/config_fields.h"

#include <nlohmann/json.hpp>

#include <cstdio>

namespace fsdpp {

using nlohmann::json;
using namespace config_fields;

namespace {

// The pre-extension context of llama3 and YaRN scaling; transformers' default is
// max_position_embeddings (0 here until the caller knows it).
void read_original_context(const json& block, const std::string& where, RopeScaling& r) {
  r.original_max_position_embeddings = read<int64_t>(block, "original_max_position_embeddings", where, 0);
  if (r.original_max_position_embeddings != 0) {
    check_range(where, "original_max_position_embeddings", r.original_max_position_embeddings, 1, kMaxPositions);
  }
}

// YaRN's keys. A null factor is max_position_embeddings over the original context, which the
// caller knows (0 here until then), as transformers derives it.
void read_yarn(const json& block, const std::string& where, RopeScaling& r) {
  if (!block.contains("factor")) throw UserError(where + ": missing key 'factor'");
  if (block["factor"].is_null()) r.factor = 0.0;
  read_original_context(block, where, r);
  r.beta_fast = read<double>(block, "beta_fast", where, 32.0);
  r.beta_slow = read<double>(block, "beta_slow", where, 1.0);
  r.mscale = read<double>(block, "mscale", where, 0.0);
  check_between(where, "mscale", r.mscale, 0, 1000);
  if (block.contains("attention_factor") && !block["attention_factor"].is_null()) {
    r.attention_factor = read<double>(block, "attention_factor", where, 1.0);
    check_positive(where, "attention_factor", *r.attention_factor);
  }
  // transformers tests it for truth: null truncates nothing.
  r.truncate = read_nullable<bool>(block, "truncate", where, true, false);
  check_positive(where, "beta_fast", r.beta_fast);
  check_positive(where, "beta_slow", r.beta_slow);
}

}  // namespace

RopeBlock read_rope_block(const json& j, const std::string& origin) {
  RopeBlock rope{.values = json::object(), .name = "rope_parameters"};
  // transformers takes rope_scaling (4.x's name) in place of rope_parameters whenever it
  // holds anything: a file with both is read from rope_scaling alone.
  for (const char* name : {"rope_parameters", "rope_scaling"}) {
    auto block = j.find(name);
    if (block == j.end() || block->is_null()) continue;
    if (!block->is_object()) throw UserError(origin + ": " + name + " must be an object, got " + block->dump());
    if (block->empty()) continue;
    for (const auto& [key, value] : block->items()) {
      // transformers 5 may nest the block by layer type; every layer here attends alike.
      if (value.is_object()) {
        throw UserError(origin + ": " + name + "." + key + ": RoPE parameters per layer type are not supported");
      }
    }
    rope = {.values = *block, .name = name};
  }
  for (const char* key : {"rope_theta", "partial_rotary_factor"}) {
    auto top = j.find(key);
    if (top == j.end() || top->is_null()) continue;
    auto inner = rope.values.find(key);
    if (inner != rope.values.end() && !inner->is_null() && *inner != *top) {
      throw UserError(origin + ": " + key + " " + top->dump() + " and " + rope.name + "." + key + " " +
                      inner->dump() + " disagree (two places of one field)");
    }
    rope.values[key] = *top;
  }
  // The pre-extension context outside the block (Phi-3's place for it) wins over the block's,
  // as transformers gives it priority.
  if (auto top = j.find("original_max_position_embeddings"); top != j.end() && !top->is_null()) {
    rope.values["original_max_position_embeddings"] = *top;
  }
  const std::string where = origin + ": " + rope.name;
  if (read<double>(rope.values, "partial_rotary_factor", where, 1.0) != 1.0) {
    throw UserError(where + ": partial_rotary_factor " + rope.values["partial_rotary_factor"].dump() +
                    " is not supported (1.0)");
  }
  return rope;
}

RopeScaling read_rope_scaling(const RopeBlock& rope, const std::string& origin) {
  RopeScaling r;
  const json& block = rope.values;
  const std::string where = origin + ": " + rope.name;
  // transformers reads rope_type first and the older "type" only without it.
  const auto rope_type = read<std::string>(block, "rope_type", where, read<std::string>(block, "type", where, "default"));
  r.factor = read<double>(block, "factor", where, 1.0);
  check_positive(where, "factor", r.factor);
  // DeepSeek-V3 scales its softmax by it under any scaling but the default, YaRN's or not.
  r.mscale_all_dim = read<double>(block, "mscale_all_dim", where, 0.0);
  check_between(where, "mscale_all_dim", r.mscale_all_dim, 0, 1000);
  r.mrope_section = read<std::vector<int64_t>>(block, "mrope_section", where, {});
  for (int64_t s : r.mrope_section) check_range(where, "mrope_section", s, 1, kMaxWidth);
  if (rope_type == "llama3") {
    r.rope_type = RopeType::llama3;
    r.low_freq_factor = read<double>(block, "low_freq_factor", where, 1.0, true);
    r.high_freq_factor = read<double>(block, "high_freq_factor", where, 4.0, true);
    read_original_context(block, where, r);
    check_positive(where, "low_freq_factor", r.low_freq_factor);
    if (r.high_freq_factor <= r.low_freq_factor) {
      throw UserError(where + ": high_freq_factor " + std::to_string(r.high_freq_factor) +
                      " must exceed low_freq_factor " + std::to_string(r.low_freq_factor));
    }
  } else if (rope_type == "yarn") {
    r.rope_type = RopeType::yarn;
    read_yarn(block, where, r);
  } else if (rope_type == "linear") {
    r.rope_type = RopeType::linear;
  } else if (rope_type != "default" && rope_type != "mrope") {
    throw UserError(where + ": rope_type '" + rope_type + "' is not supported (default, linear, llama3, yarn)");
  }
  return r;
}

namespace {

// The tower's sizes in range, and the products and divisions the tower takes of them exact.
void check_vision(const VisionConfig& v, const std::string& model_type, const std::string& where) {
  check_range(where, "depth", v.depth, 1, kMaxLayers);
  check_range(where, "num_heads", v.num_heads, 1, kMaxHeads);
  for (auto [key, value] : {std::pair{"patch_size", v.patch_size}, {"temporal_patch_size", v.temporal_patch_size},
                            {"spatial_merge_size", v.spatial_merge_size}, {"in_channels", v.in_channels},
                            {"out_hidden_size", v.out_hidden_size}, {"intermediate_size", v.intermediate_size}}) {
    check_range(where, key, value, 1, kMaxWidth);
  }
  check_range(where, "width", v.embed_dim, 1, kMaxWidth);
  // The widths the tower's products take in, products of the sizes above: in double, so that
  // no product of them overflows before it is checked.
  const double patch = static_cast<double>(v.patch_size), merge = static_cast<double>(v.spatial_merge_size);
  for (auto [what, width] : {std::pair{"in_channels x temporal_patch_size x patch_size^2 (a patch's values)",
                                       static_cast<double>(v.in_channels) * static_cast<double>(v.temporal_patch_size) *
                                           patch * patch},
                             {"width x spatial_merge_size^2 (the merger's input)",
                              static_cast<double>(v.embed_dim) * merge * merge}}) {
    if (width > static_cast<double>(kMaxWidth)) {
      char shown[32];
      std::snprintf(shown, sizeof shown, "%.0f", width);
      throw UserError(where + ": " + what + " = " + shown + " exceeds " + std::to_string(kMaxWidth));
    }
  }
  check_rope_theta(where, v.rope_theta);
  if (v.windowed) {
    check_range(where, "window_size", v.window_size, 1, kMaxPositions);
    check_positive(where, "tokens_per_second", v.tokens_per_second);
    if (v.window_size % (v.patch_size * v.spatial_merge_size) != 0) {
      throw UserError(where + ": window_size " + std::to_string(v.window_size) + " is not a multiple of patch_size " +
                      std::to_string(v.patch_size) + " × spatial_merge_size " + std::to_string(v.spatial_merge_size));
    }
  }
  if (v.embed_dim <= 0 || v.num_heads <= 0 || v.embed_dim % v.num_heads != 0) {
    throw UserError(where + ": width " + std::to_string(v.embed_dim) + " must be a positive multiple of num_heads " +
                    std::to_string(v.num_heads));
  }
  const std::string expected = model_type == "qwen2_vl" ? "quick_gelu" : "silu";
  if (v.hidden_act != expected) {
    throw UserError(where + ": hidden_act '" + v.hidden_act + "' is not supported (" + expected + ")");
  }
}

}  // namespace

VisionConfig read_vision(const json& j, const std::string& model_type, const std::string& origin) {
  const std::string where = origin + ": vision_config";
  VisionConfig v;
  v.depth = read_spelled<int64_t>(j, {"depth", "num_hidden_layers"}, where, 0, true);
  v.num_heads = read_spelled<int64_t>(j, {"num_heads", "num_attention_heads"}, where, 0, true);
  v.patch_size = read<int64_t>(j, "patch_size", where, 14);
  v.temporal_patch_size = read<int64_t>(j, "temporal_patch_size", where, 2);
  v.spatial_merge_size = read<int64_t>(j, "spatial_merge_size", where, 2);
  v.in_channels = read_spelled<int64_t>(j, {"in_channels", "in_chans"}, where, 3);
  const RopeBlock rope = read_rope_block(j, where);
  const std::string rope_where = where + ": " + rope.name;
  v.rope_theta = read<double>(rope.values, "rope_theta", rope_where, 10000.0);
  const auto rope_type = read<std::string>(rope.values, "rope_type", rope_where, "axial");
  if (rope_type != "axial" && rope_type != "default") {
    throw UserError(rope_where + ": rope_type '" + rope_type + "' is not supported (axial)");
  }
  if (model_type == "qwen2_vl") {
    v.embed_dim = read<int64_t>(j, "embed_dim", where, 0, true);
    v.out_hidden_size = read<int64_t>(j, "hidden_size", where, 0, true);
    // Checked as a double: a ratio past int64 would make the cast undefined.
    const double inner = static_cast<double>(v.embed_dim) * read<double>(j, "mlp_ratio", where, 4.0);
    if (!(inner >= 1 && inner <= static_cast<double>(kMaxWidth))) {
      throw UserError(where + ": embed_dim x mlp_ratio = " + std::to_string(inner) + " is not in [1, " +
                      std::to_string(kMaxWidth) + "]");
    }
    v.intermediate_size = static_cast<int64_t>(inner);
    v.hidden_act = read<std::string>(j, "hidden_act", where, "quick_gelu");
  } else {
    v.windowed = true;
    v.embed_dim = read<int64_t>(j, "hidden_size", where, 0, true);
    v.out_hidden_size = read<int64_t>(j, "out_hidden_size", where, 0, true);
    v.intermediate_size = read<int64_t>(j, "intermediate_size", where, 0, true);
    v.hidden_act = read<std::string>(j, "hidden_act", where, "silu");
    v.window_size = read<int64_t>(j, "window_size", where, 112);
    v.fullatt_block_indexes = read<std::vector<int64_t>>(j, "fullatt_block_indexes", where, {7, 15, 23, 31});
    v.tokens_per_second = read<double>(j, "tokens_per_second", where, 4.0);
  }
  check_vision(v, model_type, where);
  return v;
}


// Qwen3-MoE's experts; defaults as transformers' Qwen3MoeConfig.
MoeConfig read_qwen3_moe(const json& j, int64_t layers, const std::string& origin) {
  MoeConfig m;
  const std::string experts = spelled_key(j, {"num_local_experts", "num_experts"}, origin);
  m.num_experts = read<int64_t>(j, experts, origin, 0, true);
  m.num_experts_per_tok = read<int64_t>(j, "num_experts_per_tok", origin, 0, true);
  m.moe_intermediate_size = read<int64_t>(j, "moe_intermediate_size", origin, 0, true);
  m.norm_topk_prob = read<bool>(j, "norm_topk_prob", origin, false);
  m.decoder_sparse_step = read<int64_t>(j, "decoder_sparse_step", origin, 1);
  m.mlp_only_layers = read<std::vector<int64_t>>(j, "mlp_only_layers", origin, {});
  m.router_aux_loss_coef = read<double>(j, "router_aux_loss_coef", origin, 0.001);
  check_between(origin, "router_aux_loss_coef", m.router_aux_loss_coef, 0, 1000);
  check_range(origin, experts, m.num_experts, 1, kMaxExperts);
  check_range(origin, "num_experts_per_tok", m.num_experts_per_tok, 1, m.num_experts);
  check_range(origin, "moe_intermediate_size", m.moe_intermediate_size, 1, kMaxWidth);
  check_range(origin, "decoder_sparse_step", m.decoder_sparse_step, 1, layers);
  for (int64_t layer : m.mlp_only_layers) check_range(origin, "mlp_only_layers", layer, 0, layers - 1);
  if (m.router_aux_loss_coef < 0) throw UserError(origin + ": router_aux_loss_coef must not be negative");
  return m;
}

// DeepSeek-V3's experts; defaults as transformers' DeepseekV3Config.
MoeConfig read_deepseek_moe(const json& j, int64_t layers, const std::string& origin) {
  MoeConfig m{.routing = MoeConfig::Routing::grouped_sigmoid};
  const std::string experts = spelled_key(j, {"n_routed_experts", "num_local_experts"}, origin);
  m.num_experts = read<int64_t>(j, experts, origin, 256);
  m.num_experts_per_tok = read<int64_t>(j, "num_experts_per_tok", origin, 8);
  m.moe_intermediate_size = read<int64_t>(j, "moe_intermediate_size", origin, 2048);
  // transformers tests the switch as it stands, so a null is false, not the default.
  m.norm_topk_prob = read_nullable<bool>(j, "norm_topk_prob", origin, true, false);
  m.first_k_dense_replace = read<int64_t>(j, "first_k_dense_replace", origin, 3);
  m.n_shared_experts = read<int64_t>(j, "n_shared_experts", origin, 1);
  m.routed_scaling_factor = read<double>(j, "routed_scaling_factor", origin, 2.5);
  check_between(origin, "routed_scaling_factor", m.routed_scaling_factor, 0, 1000);
  m.n_group = read<int64_t>(j, "n_group", origin, 8);
  m.topk_group = read<int64_t>(j, "topk_group", origin, 4);
  check_range(origin, experts, m.num_experts, 1, kMaxExperts);
  check_range(origin, "moe_intermediate_size", m.moe_intermediate_size, 1, kMaxWidth);
  check_range(origin, "first_k_dense_replace", m.first_k_dense_replace, 0, layers);
  check_range(origin, "n_shared_experts", m.n_shared_experts, 0, kMaxExperts);
  check_positive(origin, "routed_scaling_factor", m.routed_scaling_factor);
  check_range(origin, "n_group", m.n_group, 1, m.num_experts);
  if (m.num_experts % m.n_group != 0 || m.num_experts / m.n_group < 2) {
    throw UserError(origin + ": " + experts + " " + std::to_string(m.num_experts) + " must split into n_group " +
                    std::to_string(m.n_group) + " groups of at least 2 experts (a group scores by its best two)");
  }
  check_range(origin, "topk_group", m.topk_group, 1, m.n_group);
  check_range(origin, "num_experts_per_tok", m.num_experts_per_tok, 1, m.topk_group * (m.num_experts / m.n_group));
  return m;
}

// DeepSeek-V3's attention widths; defaults as transformers' DeepseekV3Config.
LatentAttentionConfig read_latent_attention(const json& j, const std::string& origin) {
  LatentAttentionConfig a;
  a.q_lora_rank = read_nullable<int64_t>(j, "q_lora_rank", origin, 1536, 0);  // null: no query compression
  a.kv_lora_rank = read<int64_t>(j, "kv_lora_rank", origin, 512);
  a.qk_nope_head_dim = read<int64_t>(j, "qk_nope_head_dim", origin, 128);
  a.qk_rope_head_dim = read<int64_t>(j, "qk_rope_head_dim", origin, 64);
  a.v_head_dim = read<int64_t>(j, "v_head_dim", origin, 128);
  a.rope_interleave = read_nullable<bool>(j, "rope_interleave", origin, true, false);  // null: false (a bare if)
  if (a.q_lora_rank != 0) check_range(origin, "q_lora_rank", a.q_lora_rank, 1, kMaxWidth);
  for (auto [key, value] : {std::pair{"kv_lora_rank", a.kv_lora_rank}, {"qk_nope_head_dim", a.qk_nope_head_dim},
                            {"qk_rope_head_dim", a.qk_rope_head_dim}, {"v_head_dim", a.v_head_dim}}) {
    check_range(origin, key, value, 1, kMaxWidth);
  }
  return a;
}

}  // namespace fsdpp
