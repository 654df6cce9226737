// Attention over packed documents: whichever scope attention_scope picks (a mask on the CPU
// and for float32; the variable-length flash kernel for bf16 and fp16 on a GPU, when the test
// runs on one), each document's outputs and gradients are those of causal attention over that
// document alone, and a packed model gives each document the logits it gives it alone and
// the parameter gradients of each document alone, summed.
#include "core/module_tree.h"
#include "models/document_attention.h"
#include "models/registry.h"
#include "tensor_checks.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/autograd.h>

#include <functional>
#include <map>

using namespace fsdpp;

namespace {

constexpr int64_t B = 2, T = 12;
// Five documents in two rows of 12, the second row ending in a single-token document.
const std::vector<int64_t> kOffsets{0, 5, 12, 15, 23, 24};

struct Setting {
  c10::Device device;
  at::ScalarType dtype;
  // Whether the layers attend through the flash kernel: bf16 or fp16 on a GPU (of compute
  // capability 8.0 or newer, as every GPU the checks run on).
  bool flash() const { return device.is_cuda() && (dtype == at::kBFloat16 || dtype == at::kHalf); }
};

// float32 on the CPU; bf16, fp16 and float32 on the GPU where the test has one (nullopt where
// not): which is 0 to 3.
std::optional<Setting> setting(int which) {
  if (which == 0) return Setting{c10::Device(c10::kCPU), at::kFloat};
  if (!gpu_half_runs()) return std::nullopt;
  const at::ScalarType dtypes[] = {at::kBFloat16, at::kHalf, at::kFloat};
  return Setting{c10::Device(c10::kCUDA, 0), dtypes[which - 1]};
}

// Bounds are measured where the test runs, not chosen: ten times the farthest the reference
// computed in the setting's dtype lies from the same computation in float64 (its rounding on
// this CPU or GPU). The kernels under test round the same sums in another order.
constexpr double kNoiseFactor = 10;

// Document s of packed rows [B, ...] whose token dimension is `dim` (counted without B): its
// row, narrowed to the document's tokens.
at::Tensor in_document(const at::Tensor& rows, size_t s, int64_t dim) {
  return rows[kOffsets[s] / T].narrow(dim, kOffsets[s] % T, kOffsets[s + 1] - kOffsets[s]);
}

// Causal attention over each document on its own, written back into its rows: [B, H, T, Dv].
at::Tensor each_document_alone(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  std::vector<at::Tensor> pieces;
  for (size_t s = 0; s + 1 < kOffsets.size(); ++s) {
    const auto part = [&](const at::Tensor& x) { return in_document(x, s, 1).unsqueeze(0); };
    pieces.push_back(at::scaled_dot_product_attention(part(q), part(k), part(v), {}, 0.0, /*is_causal=*/true,
                                                      std::nullopt, /*enable_gqa=*/true));  // [1, H, L, Dv]
  }
  std::vector<at::Tensor> rows(B);
  for (int64_t r = 0; r < B; ++r) {
    std::vector<at::Tensor> in_row;
    for (size_t s = 0; s + 1 < kOffsets.size(); ++s) {
      if (kOffsets[s] / T == r) in_row.push_back(pieces[s]);
    }
    rows[r] = at::cat(in_row, 2);  // [1, H, T, Dv]
  }
  return at::cat(rows, 0);
}

using Gradients = std::map<std::string, at::Tensor>;  // float64, by parameter name

Gradients gradients(CausalLM& model, const std::function<at::Tensor()>& loss) {
  for (const auto& p : unique_named_parameters(model)) p.tensor.mutable_grad() = at::Tensor();
  loss().backward();
  Gradients grads;
  for (const auto& p : unique_named_parameters(model)) grads[p.name] = p.tensor.grad().to(at::kDouble);
  return grads;
}

// A loss over every position: the rows hold no padding, so the packed rows' loss is the sum
// of each document's alone.
at::Tensor packed_loss(CausalLM& model, const at::Tensor& ids) {
  return model(ids, RowLayout{at::tensor(kOffsets, at::kLong)}).to(at::kDouble).square().sum();
}

at::Tensor documents_alone_loss(CausalLM& model, const at::Tensor& ids) {
  at::Tensor total = at::zeros({}, at::TensorOptions(at::kDouble).device(ids.device()));
  for (size_t s = 0; s + 1 < kOffsets.size(); ++s) {
    total = total + model(in_document(ids, s, 0).unsqueeze(0)).to(at::kDouble).square().sum();
  }
  return total;
}

// The Llama both packed-model tests run, with token ids [B, T] on its device.
struct PackedLlama {
  ModelConfig config;
  std::shared_ptr<CausalLM> model;
  at::Tensor ids;  // [B, T]
};

PackedLlama packed_llama(const Setting& where) {
  auto config = ModelConfig::from_json(
      {{"model_type", "llama"}, {"vocab_size", 37}, {"hidden_size", 64}, {"intermediate_size", 96},
       {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}},
      "document_attention_test");
  auto model = build_model(config, at::TensorOptions(where.dtype).device(where.device));
  init_parameters(*model, /*seed=*/3, config.initializer_range);
  auto ids = at::randint(0, 37, {B, T}, at::TensorOptions(at::kLong).device(where.device));
  return {std::move(config), std::move(model), std::move(ids)};
}

}  // namespace

TEST_CASE("attention within packed documents equals each document alone, forward and backward", "[models][gpu]") {
  const auto where = setting(GENERATE(0, 1, 2, 3));
  if (!where) return;  // the GPU settings run where the test has a GPU
  // Llama's query/key/value head size, and latent attention's narrower values.
  const int64_t value_dim = GENERATE(16, 8);
  INFO(where->device << " " << where->dtype << ", value head size " << value_dim);
  const auto opts = at::TensorOptions(where->dtype).device(where->device);
  const auto documents = at::tensor(kOffsets, at::kLong);

  const bool flash = where->flash();
  const auto chosen = attention_scope(documents, /*window=*/0, B, T, opts, /*head_dim=*/16);
  REQUIRE(chosen.defined());
  CHECK(chosen.scalar_type() == (flash ? at::kInt : at::kBool));
  // The offsets themselves, as a layer computing in float32 may be handed them: in float32
  // it attends through their mask.
  const bool offsets = GENERATE(false, true);
  const auto scope = offsets ? documents.to(where->device, at::kInt) : chosen;
  INFO((offsets ? "the offsets" : "attention_scope's choice"));
  // A window shorter than the rows needs the mask on every device.
  CHECK(attention_scope(documents, /*window=*/4, B, T, opts, 16).scalar_type() == at::kBool);
  CHECK_FALSE(attention_scope({}, /*window=*/T, B, T, opts, 16).defined());

  at::manual_seed(5);
  const auto leaf = [&](int64_t heads, int64_t width) {
    return at::randn({B, heads, T, width}, opts).requires_grad_();
  };
  const auto q = leaf(4, 16), k = leaf(2, 16), v = leaf(2, value_dim);  // two query heads per key head
  const auto out = scoped_attention(q, k, v, scope);  // [B, H, T, Dv]
  CHECK(backward_runs(out, "FlashAttentionBackward0") == flash);
  const auto grad_out = at::randn_like(out);
  const auto grads = torch::autograd::grad({out}, {q, k, v}, {grad_out});

  const auto expected = each_document_alone(q, k, v);
  const auto expected_grads = torch::autograd::grad({expected}, {q, k, v}, {grad_out});
  const auto in_float64 = [](const at::Tensor& x) { return x.detach().to(at::kDouble).requires_grad_(); };
  const auto q64 = in_float64(q), k64 = in_float64(k), v64 = in_float64(v);
  const auto truth = each_document_alone(q64, k64, v64);
  const auto truth_grads = torch::autograd::grad({truth}, {q64, k64, v64}, {grad_out.to(at::kDouble)});
  double noise = relative_error(expected.to(at::kDouble), truth);
  for (size_t i = 0; i < 3; ++i) noise = std::max(noise, relative_error(expected_grads[i].to(at::kDouble), truth_grads[i]));
  INFO("rounding noise " << noise);

  CHECK(relative_error(out.to(at::kDouble), expected.to(at::kDouble)) < kNoiseFactor * noise);
  for (size_t i = 0; i < 3; ++i) {
    INFO("gradient of " << "qkv"[i]);
    CHECK(relative_error(grads[i].to(at::kDouble), expected_grads[i].to(at::kDouble)) < kNoiseFactor * noise);
  }
}

TEST_CASE("a packed Llama gives each document the logits and parameter gradients of that document alone",
          "[models][gpu]") {
  const auto where = setting(GENERATE(0, 1, 2, 3));
  if (!where) return;
  INFO(where->device << " " << where->dtype);
  const PackedLlama llama = packed_llama(*where);
  CausalLM& model = *llama.model;
  const at::Tensor& ids = llama.ids;  // [B, T]
  const auto twin = float64_twin(llama.config, model);

  SECTION("logits") {
    const auto packed = model(ids, RowLayout{at::tensor(kOffsets, at::kLong)});  // [B, T, V]
    CHECK(backward_runs(packed, "FlashAttentionBackward0") == where->flash());
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> alone;  // each document's logits [L, V] computed alone
    double noise = 0;
    for (size_t s = 0; s + 1 < kOffsets.size(); ++s) {
      const auto document = in_document(ids, s, 0).unsqueeze(0);  // [1, L]
      alone.push_back(model(document)[0].to(at::kDouble));
      noise = std::max(noise, relative_error(alone.back(), (*twin)(document)[0]));
    }
    INFO("rounding noise " << noise);
    for (size_t s = 0; s + 1 < kOffsets.size(); ++s) {
      INFO("document " << s);
      CHECK(relative_error(in_document(packed, s, 0).to(at::kDouble), alone[s]) < kNoiseFactor * noise);
    }
  }

  SECTION("parameter gradients, summed over the documents") {
    const Gradients packed = gradients(model, [&] { return packed_loss(model, ids); });
    const Gradients alone = gradients(model, [&] { return documents_alone_loss(model, ids); });
    const Gradients truth = gradients(*twin, [&] { return documents_alone_loss(*twin, ids); });
    double noise = 0;
    for (const auto& [name, grad] : alone) noise = std::max(noise, relative_error(grad, truth.at(name)));
    INFO("rounding noise " << noise);
    REQUIRE(packed.size() == alone.size());
    for (const auto& [name, grad] : packed) {
      INFO(name);
      CHECK(relative_error(grad, alone.at(name)) < kNoiseFactor * noise);
    }
  }
}
