// Leaf modules shared by every model: Linear, Embedding, RMSNorm and the rotary position
// tables, with Hugging Face's parameter names and initialisation.
#pragma once

#include "core/module.h"
#include "models/model_config.h"

namespace fsdpp {

// Fills `t` with N(0, std^2) drawn in float32 from `gen`, as the initialisers here all draw.
void fill_normal(torch::Tensor& t, at::Generator& gen, double std);

class LoraFactor;

class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias, const torch::TensorOptions& opts);
  // Shares `weight` instead of owning one (tied embeddings).
  explicit Linear(torch::Tensor tied_weight);
  FSDPP_MODULE_CALL
  // [..., in] -> [..., out] in the weight's dtype; with an adapter, plus
  // lora_B(lora_A(dropout(x))) * alpha / rank.
  torch::Tensor forward(const torch::Tensor& input);
  void init_parameter(const std::string& name, torch::Tensor& t, at::Generator& gen,
                      double std) override;
  // Adds PEFT's low-rank adapter: children lora_A [rank, in] and lora_B [out, rank].
  void add_adapter(int64_t rank, double alpha, double dropout, const torch::TensorOptions& opts);
  bool has_adapter() const { return lora_A_ != nullptr; }

  torch::Tensor weight;  // [out, in]
  torch::Tensor bias;    // [out] or undefined
  // Set by the unit that owns the weight when it declares precision{compute = "fp8"} and the
  // weight fits (models/fp8_product.h): bf16 inputs then multiply in float8.
  bool fp8_products = false;

 private:
  std::shared_ptr<LoraFactor> lora_A_, lora_B_;
  double lora_scaling_ = 0.0;
  double lora_dropout_ = 0.0;
};

// One factor of a LoRA adapter, a Linear without bias initialised as PEFT initialises it:
// A uniform in ±1/sqrt(in) (kaiming_uniform with a = sqrt(5)), B zero, so a new adapter
// leaves the model's outputs unchanged.
class LoraFactor : public Linear {
 public:
  enum class Kind { A, B };
  LoraFactor(Kind kind, int64_t in_features, int64_t out_features, const torch::TensorOptions& opts)
      : Linear(in_features, out_features, /*bias=*/false, opts), kind_(kind) {}
  void init_parameter(const std::string& name, torch::Tensor& t, at::Generator& gen, double std) override;

 private:
  Kind kind_;
};

class Embedding : public Module {
 public:
  // `padding_row`: a row (>= 0) that gets no gradient and starts at zero; -1: none.
  Embedding(int64_t num_embeddings, int64_t dim, const torch::TensorOptions& opts, int64_t padding_row = -1);
  FSDPP_MODULE_CALL
  // [B, T] -> [B, T, C]; backward adds into weight.grad in place (models/embedding_rows.h).
  torch::Tensor forward(const torch::Tensor& ids);
  void init_parameter(const std::string& name, torch::Tensor& t, at::Generator& gen,
                      double std) override;

  torch::Tensor weight;  // [V, C]

 private:
  int64_t padding_row_;
};

class RMSNorm : public Module {
 public:
  RMSNorm(std::string class_name, int64_t dim, double eps, const torch::TensorOptions& opts);
  FSDPP_MODULE_CALL
  torch::Tensor forward(const torch::Tensor& x);  // [..., C] -> [..., C]
  void init_parameter(const std::string& name, torch::Tensor& t, at::Generator& gen,
                      double std) override;

  torch::Tensor weight;  // [C]
  double eps;
};

class LayerNorm : public Module {
 public:
  LayerNorm(int64_t dim, double eps, const torch::TensorOptions& opts);
  FSDPP_MODULE_CALL
  torch::Tensor forward(const torch::Tensor& x);  // [..., C] -> [..., C]
  void init_parameter(const std::string& name, torch::Tensor& t, at::Generator& gen,
                      double std) override;

  torch::Tensor weight, bias;  // [C]
  double eps;
};

// cos and sin tables for rotary embeddings, recomputed rather than stored (a
// non-persistent buffer in Hugging Face's models).
class RotaryEmbedding : public Module {
 public:
  RotaryEmbedding(std::string class_name, const ModelConfig& config, const torch::Device& device);
  FSDPP_MODULE_CALL
  // positions [T] or [B, T] -> [2, T, D] or [2, B, T, D]: cos then sin, in float32. Multimodal RoPE (mrope_section
  // set): positions [3, B, T] (temporal, height, width) -> [2, B, T, D], each frequency
  // taking its axis's position.
  torch::Tensor forward(const torch::Tensor& positions);
  // Moves the frequencies to where the positions come from, once: a sharded model is
  // placed unit by unit and this table is no parameter of any unit.
  void follow(const torch::Device& device) {
    if (inv_freq.device() != device) inv_freq = inv_freq.to(device);
  }

  torch::Tensor inv_freq;  // [D / 2]
  std::vector<int64_t> mrope_section;
  double attention_scaling = 1.0;  // YaRN scales the tables by this
};

// The extra factor DeepSeek-V3 applies to its softmax scale under any RoPE scaling but the
// default that gives mscale_all_dim, YaRN's or not (1 otherwise).
double yarn_softmax_scale(const RopeScaling& scaling);

}  // namespace fsdpp
