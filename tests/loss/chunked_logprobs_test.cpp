// Chunked log-probabilities and entropies against log_softmax of the full logits: values and
// gradients (hidden states and head) for chunks that split the tokens evenly, unevenly and one
// by one, at a temperature, in float64 and in float32.
#include "loss/chunked_logprobs.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <torch/torch.h>

using namespace fsdpp;

namespace {

struct Result {
  at::Tensor logprobs, entropy, grad_hidden, grad_weight;
};

// Forward and the gradient of a weighted sum of the log-probabilities (weights `scale`) and
// of the entropies where given (`entropy_scale`), so each token's gradient is scaled apart.
template <class Logprobs>
Result run(const at::Tensor& hidden0, const at::Tensor& weight0, const at::Tensor& scale,
           const at::Tensor& entropy_scale, Logprobs logprobs) {
  const at::Tensor hidden = hidden0.clone().requires_grad_(true);
  const at::Tensor weight = weight0.clone().requires_grad_(true);
  const TokenLogprobs out = logprobs(hidden, weight);
  at::Tensor loss = scale.defined() ? (out.logprobs * scale).sum() : at::zeros({}, hidden.options());
  if (entropy_scale.defined()) loss = loss + (out.entropy * entropy_scale).sum();
  loss.backward();
  return {out.logprobs.detach(), out.entropy.defined() ? out.entropy.detach() : at::Tensor(), hidden.grad(),
          weight.grad()};
}

// log_softmax of the full logits at the targets, and the softmax's entropy.
TokenLogprobs full_logprobs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                            double temperature) {
  const at::Tensor log_p = at::log_softmax(hidden.mm(weight.t()) / temperature, -1);  // [N, V]
  return {log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)};
}

}  // namespace

TEST_CASE("chunked log-probabilities equal log_softmax of the full logits, and so do their gradients", "[loss]") {
  const int64_t tokens = 10, width = 6, vocab = 13;
  for (const auto dtype : {at::kDouble, at::kFloat}) {
    at::manual_seed(3);
    const auto opts = at::TensorOptions().dtype(dtype);
    const at::Tensor hidden = at::randn({tokens, width}, opts);   // [N, C]
    const at::Tensor weight = at::randn({vocab, width}, opts);    // [V, C]
    const at::Tensor targets = at::randint(vocab, {tokens}, at::kLong);
    const at::Tensor scale = at::randn({tokens}, opts);
    const at::Tensor entropy_scale = at::randn({tokens}, opts);
    const double temperature = 0.7;
    // float32: logits of size about 5 round at 6e-8 of it, and a chunk's product may take
    // another kernel than the whole's, on any CPU: gaps near 1e-6. A chunk misplaced or a
    // gradient term lost moves values by 1e-1.
    const double bound = dtype == at::kDouble ? 1e-12 : 1e-4;
    // The log-probabilities' gradient alone, the entropies' alone, and both.
    for (const auto& [lp_scale, h_scale] : {std::pair{scale, at::Tensor()}, std::pair{at::Tensor(), entropy_scale},
                                            std::pair{scale, entropy_scale}}) {
      const bool with_entropy = h_scale.defined();
      const Result want = run(hidden, weight, lp_scale, h_scale, [&](const at::Tensor& h, const at::Tensor& w) {
        return full_logprobs(h, w, targets, temperature);
      });
      for (const int64_t chunk : {int64_t{1}, int64_t{3}, int64_t{5}, tokens, int64_t{64}}) {
        CAPTURE(dtype, chunk, with_entropy, lp_scale.defined());
        const Result got = run(hidden, weight, lp_scale, h_scale, [&](const at::Tensor& h, const at::Tensor& w) {
          return chunked_logprobs(h, w, targets, temperature, chunk, with_entropy);
        });
        CHECK(got.logprobs.scalar_type() == dtype);
        CHECK((got.logprobs - want.logprobs).abs().max().item<double>() < bound);
        CHECK(got.entropy.defined() == with_entropy);
        if (with_entropy) CHECK((got.entropy - want.entropy).abs().max().item<double>() < bound);
        CHECK((got.grad_hidden - want.grad_hidden).abs().max().item<double>() < bound);
        CHECK((got.grad_weight - want.grad_weight).abs().max().item<double>() < bound);
      }
    }
  }
}
