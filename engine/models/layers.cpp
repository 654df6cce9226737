// Leaf modules. Numerics follow Hugging Face's implementations step for step (RMSNorm in
// float32, RoPE tables in float32) so logits match transformers to rounding; a float64
// model normalises in float64.
#include "models/layers.h"

#include "models/embedding_rows.h"
#include "models/fp8_product.h"

#include <ATen/ATen.h>

#include <cmath>
#include <numbers>

namespace fsdpp {

void fill_normal(torch::Tensor& t, at::Generator& gen, double std) {
  t.copy_(at::normal(0.0, std, t.sizes(), gen, torch::TensorOptions().dtype(torch::kFloat32)));
}

Linear::Linear(int64_t in_features, int64_t out_features, bool with_bias,
               const torch::TensorOptions& opts)
    : Module("Linear") {
  weight = register_parameter("weight", new_parameter({out_features, in_features}, opts));
  if (with_bias) bias = register_parameter("bias", new_parameter({out_features}, opts));
}

Linear::Linear(torch::Tensor tied_weight) : Module("Linear") {
  weight = register_parameter("weight", std::move(tied_weight));
}

torch::Tensor Linear::forward(const torch::Tensor& input) {
  // A product computes in its weight's dtype, the one its unit gathers in: an input of another
  // (the output of an inner unit computing in another dtype, with no precision.output) is
  // cast to it, as a unit casts its own forward's inputs.
  const torch::Tensor x = input.scalar_type() == weight.scalar_type() ? input : input.to(weight.scalar_type());
  auto out = fp8_products && x.is_cuda() && x.scalar_type() == at::kBFloat16
                 ? (bias.defined() ? fp8_linear(x, weight) + bias : fp8_linear(x, weight))
                 : at::linear(x, weight, bias);
  if (!lora_A_) return out;
  const auto dropped = lora_dropout_ > 0 ? at::dropout(x, lora_dropout_, is_training()) : x;
  return out + (*lora_B_)((*lora_A_)(dropped)) * lora_scaling_;
}

void Linear::add_adapter(int64_t rank, double alpha, double dropout, const torch::TensorOptions& opts) {
  lora_A_ = register_child("lora_A", std::make_shared<LoraFactor>(LoraFactor::Kind::A, weight.size(1), rank, opts));
  lora_B_ = register_child("lora_B", std::make_shared<LoraFactor>(LoraFactor::Kind::B, rank, weight.size(0), opts));
  lora_scaling_ = alpha / static_cast<double>(rank);
  lora_dropout_ = dropout;
}

void LoraFactor::init_parameter(const std::string&, torch::Tensor& t, at::Generator& gen, double) {
  if (kind_ == Kind::B) {
    t.zero_();
    return;
  }
  const double bound = 1.0 / std::sqrt(static_cast<double>(t.size(1)));
  t.copy_(at::rand(t.sizes(), gen, torch::TensorOptions().dtype(torch::kFloat32)) * (2 * bound) - bound);
}

void Linear::init_parameter(const std::string& name, torch::Tensor& t, at::Generator& gen,
                            double std) {
  if (name == "bias") {
    t.zero_();
  } else {
    fill_normal(t, gen, std);
  }
}

Embedding::Embedding(int64_t num_embeddings, int64_t dim, const torch::TensorOptions& opts, int64_t padding_row)
    : Module("Embedding"), padding_row_(padding_row) {
  weight = register_parameter("weight", new_parameter({num_embeddings, dim}, opts));
}

torch::Tensor Embedding::forward(const torch::Tensor& ids) { return embedding_rows(weight, ids, padding_row_); }

void Embedding::init_parameter(const std::string&, torch::Tensor& t, at::Generator& gen,
                               double std) {
  fill_normal(t, gen, std);
  if (padding_row_ >= 0) t[padding_row_].zero_();
}

RMSNorm::RMSNorm(std::string class_name, int64_t dim, double eps_,
                 const torch::TensorOptions& opts)
    : Module(std::move(class_name)), eps(eps_) {
  weight = register_parameter("weight", new_parameter({dim}, opts));
}

torch::Tensor RMSNorm::forward(const torch::Tensor& x) {
  // On a GPU, ATen's fused kernel: one pass each way instead of the six memory-bound passes
  // below. It rounds once to x's dtype where transformers rounds before and after the weight.
  if (x.is_cuda() && x.scalar_type() == weight.scalar_type()) return at::rms_norm(x, {x.size(-1)}, weight, eps);
  auto wide = x.to(at::promote_types(x.scalar_type(), torch::kFloat32));  // float64 stays float64
  auto variance = wide.pow(2).mean(-1, /*keepdim=*/true);
  wide = wide * at::rsqrt(variance + eps);
  return weight * wide.to(x.scalar_type());
}

void RMSNorm::init_parameter(const std::string&, torch::Tensor& t, at::Generator&, double) {
  t.fill_(1.0);
}

LayerNorm::LayerNorm(int64_t dim, double eps_, const torch::TensorOptions& opts) : Module("LayerNorm"), eps(eps_) {
  weight = register_parameter("weight", new_parameter({dim}, opts));
  bias = register_parameter("bias", new_parameter({dim}, opts));
}

torch::Tensor LayerNorm::forward(const torch::Tensor& x) {
  return at::layer_norm(x, {x.size(-1)}, weight, bias, eps);
}

void LayerNorm::init_parameter(const std::string& name, torch::Tensor& t, at::Generator&, double) {
  t.fill_(name == "weight" ? 1.0 : 0.0);
}

namespace {

// YaRN's frequencies: those that turn fewer than beta_slow times over the old context are
// interpolated (divided by the factor), those that turn more than beta_fast times kept, and
// a linear ramp over the dimensions between.
torch::Tensor yarn_frequencies(const torch::Tensor& freq, const RopeScaling& s, double base, int64_t dim) {
  const double context = static_cast<double>(s.original_max_position_embeddings);
  auto dimension_of = [&](double rotations) {  // the dimension that turns `rotations` times
    return static_cast<double>(dim) * std::log(context / (rotations * 2 * std::numbers::pi)) / (2 * std::log(base));
  };
  double low = dimension_of(s.beta_fast), high = dimension_of(s.beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // no empty ramp
  auto ramp = ((torch::arange(dim / 2, torch::kFloat32) - low) / (high - low)).clamp(0, 1);  // [D / 2]
  auto kept = 1 - ramp;
  return freq / s.factor * (1 - kept) + freq * kept;
}

double yarn_mscale(double factor, double mscale) { return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0; }

// How much YaRN scales cos and sin (and so every attention logit, twice over).
double yarn_attention_factor(const RopeScaling& s) {
  if (s.attention_factor) return *s.attention_factor;
  if (s.mscale != 0 && s.mscale_all_dim != 0) return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim);
  return yarn_mscale(s.factor, 1.0);
}

}  // namespace

double yarn_softmax_scale(const RopeScaling& s) {
  if (s.rope_type == RopeType::plain || s.mscale_all_dim == 0) return 1.0;
  const double m = yarn_mscale(s.factor, s.mscale_all_dim);
  return m * m;
}

RotaryEmbedding::RotaryEmbedding(std::string class_name, const ModelConfig& config,
                                 const torch::Device& device)
    : Module(std::move(class_name)) {
  const int64_t dim = config.head_dim;
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  auto exponent = torch::arange(0, dim, 2, torch::TensorOptions().dtype(torch::kInt64))
                      .to(torch::kFloat32) / static_cast<double>(dim);
  auto freq = 1.0 / torch::pow(config.rope_theta, exponent);  // [D / 2]
  const RopeScaling& s = config.rope_scaling;
  if (s.rope_type == RopeType::linear) {
    freq = freq / s.factor;
  } else if (s.rope_type == RopeType::llama3) {
    const double old_context = static_cast<double>(s.original_max_position_embeddings);
    const double low_freq_wavelen = old_context / s.low_freq_factor;
    const double high_freq_wavelen = old_context / s.high_freq_factor;
    auto wavelen = 2 * std::numbers::pi / freq;
    auto scaled = torch::where(wavelen > low_freq_wavelen, freq / s.factor, freq);
    auto smooth = (old_context / wavelen - s.low_freq_factor) /
                  (s.high_freq_factor - s.low_freq_factor);
    auto smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
    auto medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
    freq = torch::where(medium, smoothed, scaled);
  } else if (s.rope_type == RopeType::yarn) {
    freq = yarn_frequencies(freq, s, config.rope_theta, dim);
    attention_scaling = yarn_attention_factor(s);
  }
  inv_freq = freq.to(f32).to(device.is_meta() ? torch::Device(torch::kCPU) : device);
  mrope_section = s.mrope_section;
}

torch::Tensor RotaryEmbedding::forward(const torch::Tensor& positions) {
  if (positions.dim() < 3) {
    auto freqs = positions.to(torch::kFloat32).unsqueeze(-1) * inv_freq;  // [T, D/2] or [B, T, D/2]
    auto emb = torch::cat({freqs, freqs}, -1);                             // [T, D] or [B, T, D]
    auto tables = torch::stack({emb.cos(), emb.sin()});                    // [2, T, D] or [2, B, T, D]
    return attention_scaling == 1.0 ? tables : tables * attention_scaling;
  }
  auto freqs = positions.to(torch::kFloat32).unsqueeze(-1) * inv_freq;  // [3, B, T, D/2]
  auto emb = torch::cat({freqs, freqs}, -1);                             // [3, B, T, D]
  auto tables = torch::stack({emb.cos(), emb.sin()});                    // [2, 3, B, T, D]
  // Frequency chunks (the sections, twice over for the two halves) cycle through t, h, w.
  std::vector<int64_t> sections = mrope_section;
  sections.insert(sections.end(), mrope_section.begin(), mrope_section.end());
  std::vector<torch::Tensor> picked;
  int64_t start = 0;
  for (size_t i = 0; i < sections.size(); ++i) {
    picked.push_back(tables.select(1, static_cast<int64_t>(i % 3)).narrow(-1, start, sections[i]));
    start += sections[i];
  }
  const torch::Tensor joined = torch::cat(picked, -1);  // [2, B, T, D]
  return attention_scaling == 1.0 ? joined : joined * attention_scaling;
}

}  // namespace fsdpp
