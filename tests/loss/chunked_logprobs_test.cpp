// Chunked log-probabilities against log_softmax of the full logits: values and gradients
// (hidden states and head) for chunks that split the tokens evenly, unevenly and one by one,
// at a temperature, in float64 and in float32.
#include "loss/chunked_logprobs.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <torch/torch.h>

using namespace fsdpp;

namespace {

struct Result {
  at::Tensor logprobs, grad_hidden, grad_weight;
};

// Forward and the gradient of a weighted sum, so each token's gradient is scaled apart.
template <class Logprobs>
Result run(const at::Tensor& hidden0, const at::Tensor& weight0, const at::Tensor& scale, Logprobs logprobs) {
  const at::Tensor hidden = hidden0.clone().requires_grad_(true);
  const at::Tensor weight = weight0.clone().requires_grad_(true);
  const at::Tensor out = logprobs(hidden, weight);
  (out * scale).sum().backward();
  return {out.detach(), hidden.grad(), weight.grad()};
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
    const double temperature = 0.7;
    const Result want = run(hidden, weight, scale, [&](const at::Tensor& h, const at::Tensor& w) {
      return at::log_softmax(h.mm(w.t()) / temperature, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1);
    });
    // float32: logits of size about 5 round at 6e-8 of it, and a chunk's product may take
    // another kernel than the whole's, on any CPU: gaps near 1e-6. A chunk misplaced or a
    // gradient term lost moves values by 1e-1.
    const double bound = dtype == at::kDouble ? 1e-12 : 1e-4;
    for (const int64_t chunk : {int64_t{1}, int64_t{3}, int64_t{5}, tokens, int64_t{64}}) {
      CAPTURE(dtype, chunk);
      const Result got = run(hidden, weight, scale, [&](const at::Tensor& h, const at::Tensor& w) {
        return chunked_logprobs(h, w, targets, temperature, chunk);
      });
      CHECK(got.logprobs.scalar_type() == dtype);
      CHECK((got.logprobs - want.logprobs).abs().max().item<double>() < bound);
      CHECK((got.grad_hidden - want.grad_hidden).abs().max().item<double>() < bound);
      CHECK((got.grad_weight - want.grad_weight).abs().max().item<double>() < bound);
    }
  }
}
