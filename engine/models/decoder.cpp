// Llama-family decoder layers and models; attention runs through ATen's fused kernels,
// causal, or within the scope built once per forward for packed documents and sliding windows
// (models/document_attention.h).
#include "models/decoder.h"

#include "models/document_attention.h"
#include "models/elementwise.h"
#include "models/joint_projection.h"
#include "models/latent_attention.h"
#include "models/moe.h"
#include "models/residual_norm.h"

#include <ATen/ATen.h>

#include <tuple>

namespace fsdpp {

Attention::Attention(const DecoderFamily& family, const ModelConfig& c,
                     const torch::TensorOptions& opts)
    : SelfAttention(family.prefix + "Attention"),
      heads_(c.num_attention_heads),
      kv_heads_(c.num_key_value_heads),
      head_dim_(c.head_dim) {
  const bool qkv_bias = family.qkv_bias || c.attention_bias;
  q_proj_ = register_child("q_proj", std::make_shared<Linear>(c.hidden_size, heads_ * head_dim_, qkv_bias, opts));
  k_proj_ = register_child("k_proj", std::make_shared<Linear>(c.hidden_size, kv_heads_ * head_dim_, qkv_bias, opts));
  v_proj_ = register_child("v_proj", std::make_shared<Linear>(c.hidden_size, kv_heads_ * head_dim_, qkv_bias, opts));
  o_proj_ = register_child("o_proj", std::make_shared<Linear>(heads_ * head_dim_, c.hidden_size, c.attention_bias, opts));
  if (family.qk_norm) {
    q_norm_ = register_child("q_norm", std::make_shared<RMSNorm>(family.prefix + "RMSNorm", head_dim_, c.rms_norm_eps, opts));
    k_norm_ = register_child("k_norm", std::make_shared<RMSNorm>(family.prefix + "RMSNorm", head_dim_, c.rms_norm_eps, opts));
  }
}

torch::Tensor Attention::forward(const torch::Tensor& x, const torch::Tensor& cos_sin,
                                 const torch::Tensor& scope) {
  const int64_t B = x.size(0), T = x.size(1), q_width = heads_ * head_dim_, kv_width = kv_heads_ * head_dim_;
  torch::Tensor q, k, v;
  if (auto qkv = joint_projection({q_proj_.get(), k_proj_.get(), v_proj_.get()}, x); qkv.defined()) {
    // Views of the one product [B, T, (H + 2 KV) D]; backward joins their gradients in one
    // copy (where narrowed views would each fill a zeroed tensor of the whole width).
    const auto parts = qkv.split_with_sizes({q_width, kv_width, kv_width}, -1);
    q = parts[0];
    k = parts[1];
    // Attention keeps v for backward: without q/k norms, which keep q and k, a copy of its
    // few columns lets the product go once RoPE has read them.
    v = q_norm_ ? parts[2] : parts[2].contiguous();
  } else {
    q = (*q_proj_)(x);
    k = (*k_proj_)(x);
    v = (*v_proj_)(x);
  }
  q = q.view({B, T, heads_, head_dim_});     // [B, T, H, D]
  k = k.view({B, T, kv_heads_, head_dim_});  // [B, T, KV, D]
  v = v.view({B, T, kv_heads_, head_dim_});
  if (q_norm_) {
    q = (*q_norm_)(q);
    k = (*k_norm_)(k);
  }
  const auto tables = widened_rotary_tables(cos_sin);
  q = apply_rotary(q.transpose(1, 2), tables);  // [B, H, T, D]
  k = apply_rotary(k.transpose(1, 2), tables);  // [B, KV, T, D]
  std::tie(k, v) = with_cached(k, v.transpose(1, 2));  // [B, KV, cached + T, D]
  auto out = scoped_attention(q, k, v, scope);       // [B, H, T, D]
  return (*o_proj_)(out.transpose(1, 2).reshape({B, T, heads_ * head_dim_}));
}

MLP::MLP(const DecoderFamily& family, const ModelConfig& c, int64_t inner, const torch::TensorOptions& opts)
    : FeedForward(family.prefix + "MLP") {
  gate_proj_ = register_child("gate_proj", std::make_shared<Linear>(c.hidden_size, inner, c.mlp_bias, opts));
  up_proj_ = register_child("up_proj", std::make_shared<Linear>(c.hidden_size, inner, c.mlp_bias, opts));
  down_proj_ = register_child("down_proj", std::make_shared<Linear>(inner, c.hidden_size, c.mlp_bias, opts));
}

torch::Tensor MLP::forward(const torch::Tensor& x) {
  // Gate and up as one product where their weights lie end to end: the input read (and, in
  // float8, scaled) once, one product for its gradient where two would be summed.
  if (auto gate_up = joint_projection({gate_proj_.get(), up_proj_.get()}, x); gate_up.defined()) {
    return (*down_proj_)(swiglu_joined(gate_up));  // [..., 2I] -> [..., I]
  }
  return (*down_proj_)(swiglu((*gate_proj_)(x), (*up_proj_)(x)));
}

DecoderLayer::DecoderLayer(const DecoderFamily& family, const ModelConfig& c, int64_t index,
                           const torch::TensorOptions& opts, const std::shared_ptr<RoutingLog>& log)
    : Module(family.prefix + "DecoderLayer") {
  if (c.latent_attention) {
    self_attn_ = register_child<SelfAttention>("self_attn", std::make_shared<LatentAttention>(family, c, opts));
  } else {
    self_attn_ = register_child<SelfAttention>("self_attn", std::make_shared<Attention>(family, c, opts));
  }
  if (c.moe && c.moe->is_moe_layer(index)) {
    log->layers.emplace_back();
    mlp_ = register_child<FeedForward>("mlp", std::make_shared<MoeBlock>(family, c, opts, log, log->layers.size() - 1));
  } else {
    mlp_ = register_child<FeedForward>("mlp", std::make_shared<MLP>(family, c, c.intermediate_size, opts));
  }
  input_layernorm_ = register_child("input_layernorm", std::make_shared<RMSNorm>(family.prefix + "RMSNorm", c.hidden_size, c.rms_norm_eps, opts));
  post_attention_layernorm_ = register_child("post_attention_layernorm", std::make_shared<RMSNorm>(family.prefix + "RMSNorm", c.hidden_size, c.rms_norm_eps, opts));
}

torch::Tensor DecoderLayer::forward(const torch::Tensor& x, const torch::Tensor& cos_sin,
                                    const torch::Tensor& scope) {
  const auto attended = (*self_attn_)((*input_layernorm_)(x), cos_sin, scope);  // [B, T, C]
  const auto [h, normed] = add_then_norm(x, attended, *post_attention_layernorm_);
  return h + (*mlp_)(normed);
}

DecoderModel::DecoderModel(const DecoderFamily& family, const ModelConfig& c,
                           const torch::TensorOptions& opts, const std::string& class_name)
    : Module(class_name.empty() ? family.prefix + "Model" : class_name),
      sliding_window_(c.sliding_window),
      attention_head_dim_(c.query_key_head_dim()),
      routing_(c.moe ? std::make_shared<RoutingLog>() : nullptr) {
  embed_tokens = register_child("embed_tokens", std::make_shared<Embedding>(c.vocab_size, c.hidden_size, opts, c.padding_row));
  auto layers = register_child("layers", std::make_shared<ModuleList>());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    layers_.push_back(layers->append(std::make_shared<DecoderLayer>(family, c, i, opts, routing_)));
  }
  norm_ = register_child("norm", std::make_shared<RMSNorm>(family.prefix + "RMSNorm", c.hidden_size, c.rms_norm_eps, opts));
  rotary_emb_ = register_child("rotary_emb", std::make_shared<RotaryEmbedding>(family.prefix + "RotaryEmbedding", c, opts.device()));
}

torch::Tensor DecoderModel::forward(const torch::Tensor& input_ids, const torch::Tensor& documents) {
  const int64_t B = input_ids.size(0), T = input_ids.size(1);
  auto positions = documents.defined() ? document_positions(documents, B, T)           // [B, T]
                                       : torch::arange(T, input_ids.options());        // [T]
  rotary_emb_->follow(positions.device());
  auto cos_sin = (*rotary_emb_)(positions);  // [2, T, D] or [2, B, T, D]
  auto h = (*embed_tokens)(input_ids);       // [B, T, C]
  const auto scope = attention_scope(documents, sliding_window_, B, T, h.options(), attention_head_dim_);
  for (auto& layer : layers_) h = (*layer)(h, cos_sin, scope);
  return (*norm_)(h);
}

torch::Tensor DecoderModel::forward(const torch::Tensor& inputs_embeds, const torch::Tensor& position_ids,
                                    const torch::Tensor& documents) {
  rotary_emb_->follow(inputs_embeds.device());
  auto cos_sin = (*rotary_emb_)(position_ids.to(inputs_embeds.device()));  // [2, B, T, D]
  auto h = inputs_embeds;
  const auto scope = attention_scope(documents, sliding_window_, h.size(0), h.size(1), h.options(), attention_head_dim_);
  for (auto& layer : layers_) h = (*layer)(h, cos_sin, scope);
  return (*norm_)(h);
}

torch::Tensor DecoderModel::forward(const torch::Tensor& input_ids, KvCache& cache, const torch::Tensor& kept) {
  const CachedStep step = cache.begin_step(kept.to(input_ids.device()));
  // Embedded inside this module's forward, where a unit holding the embedding has gathered it.
  return forward((*embed_tokens)(input_ids), step.positions, step, cache);
}

torch::Tensor DecoderModel::forward(const torch::Tensor& inputs_embeds, const torch::Tensor& position_ids,
                                    const CachedStep& step, KvCache& cache) {
  // The prompt attends within itself as a training forward does (causal, or its documents
  // through the variable-length kernel), where a mask of its every pair would cost O(B T^2).
  const auto scope = step.scope.defined() ? step.scope
                                          : attention_scope(step.documents, sliding_window_, inputs_embeds.size(0),
                                                            inputs_embeds.size(1), inputs_embeds.options(),
                                                            attention_head_dim_);
  rotary_emb_->follow(inputs_embeds.device());
  auto cos_sin = (*rotary_emb_)(position_ids.to(inputs_embeds.device()));  // [2, B, T, D]
  // Each layer's attention reads and fills its cache for this forward alone, whatever ends it.
  struct Decoding {
    std::vector<SelfAttention*> attention;
    ~Decoding() {
      for (SelfAttention* a : attention) a->decode_into(nullptr, 0);
    }
  } decoding;
  for (size_t i = 0; i < layers_.size(); ++i) {
    decoding.attention.push_back(&layers_[i]->self_attn());
    decoding.attention.back()->decode_into(&cache.layer(i), cache.capacity());
  }
  auto h = inputs_embeds;  // [B, T, C]
  for (auto& layer : layers_) h = (*layer)(h, cos_sin, scope);
  return (*norm_)(h);
}

torch::Tensor DecoderModel::forward(const torch::Tensor& input_ids, const torch::Tensor& documents,
                                    const AtPositions& at) {
  // Embedded inside this module's forward, where a unit holding the embedding has gathered it.
  return forward((*embed_tokens)(input_ids), to_device(at.position_ids, input_ids.device()), documents);
}

DecoderCausalLM::DecoderCausalLM(const DecoderFamily& family, const ModelConfig& c,
                                 const torch::TensorOptions& opts)
    : CausalLM(family.prefix + (c.num_labels > 0 ? "ForSequenceClassification" : "ForCausalLM"), c,
               {family.prefix + "DecoderLayer"}) {
  model_ = register_child("model", std::make_shared<DecoderModel>(family, c, opts));
  if (c.num_labels > 0) {  // transformers' score: no bias, never tied
    head_ = register_child("score", std::make_shared<Linear>(c.hidden_size, c.num_labels, false, opts));
    return;
  }
  head_ = c.tie_word_embeddings ? std::make_shared<Linear>(model_->embed_tokens->weight)
                                : std::make_shared<Linear>(c.hidden_size, c.vocab_size, false, opts);
  register_child("lm_head", head_);
}

torch::Tensor DecoderCausalLM::forward(const torch::Tensor& input_ids) {
  return (*head_)((*model_)(input_ids));
}

torch::Tensor DecoderCausalLM::forward(const torch::Tensor& input_ids, const RowLayout& layout) {
  return (*head_)(hidden(input_ids, layout));
}

torch::Tensor DecoderCausalLM::forward(const torch::Tensor& input_ids, const FinalHidden& ask) {
  return hidden(input_ids, ask.layout);
}

torch::Tensor DecoderCausalLM::forward(const torch::Tensor& input_ids, const GenerationStep& step) {
  const auto hidden = (*model_)(input_ids, *step.cache, step.kept);  // [B, T, C]
  return (*head_)(hidden.select(1, hidden.size(1) - 1));            // [B, V]
}

KvCache DecoderCausalLM::generation_cache(int64_t capacity) const {
  return KvCache(model_->layer_count(), capacity, model_->sliding_window());
}

torch::Tensor DecoderCausalLM::hidden(const torch::Tensor& input_ids, const RowLayout& layout) {
  const auto documents = to_device(layout.offsets, input_ids.device());
  if (layout.positions.defined()) return (*model_)(input_ids, documents, AtPositions{layout.positions});
  return documents.defined() ? (*model_)(input_ids, documents) : (*model_)(input_ids);
}

}  // namespace fsdpp
