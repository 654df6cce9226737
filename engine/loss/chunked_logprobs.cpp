// Chunked log-probabilities as an autograd function of the hidden states and the head.
#include "loss/chunked_logprobs.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

namespace fsdpp {

namespace {

// The dtype log-softmax runs in: float32, or float64 for a float64 model.
at::ScalarType wide(at::ScalarType dtype) { return dtype == at::kDouble ? at::kDouble : at::kFloat; }

// Outputs: the log-probabilities and, with entropy, the entropies [N].
struct ChunkedLogprobs : public torch::autograd::Function<ChunkedLogprobs> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                                                const at::Tensor& weight, const at::Tensor& targets,
                                                double temperature, int64_t chunk, bool with_entropy) {
    const int64_t n = hidden.size(0);
    at::Tensor logprobs = at::empty({n}, hidden.options().dtype(wide(hidden.scalar_type())));  // [N]
    at::Tensor lse = at::empty_like(logprobs);                                                  // [N]
    // E_p[z], the softmax's mean logit: the entropy is lse - E_p[z].
    at::Tensor mean_logit = with_entropy ? at::empty_like(logprobs) : at::Tensor();            // [N]
    for (int64_t begin = 0; begin < n; begin += chunk) {
      const int64_t length = std::min(chunk, n - begin);
      const at::Tensor logits = chunk_logits(hidden.narrow(0, begin, length), weight, temperature);  // [n, V]
      const at::Tensor chunk_lse = logits.logsumexp(-1);
      lse.narrow(0, begin, length).copy_(chunk_lse);
      logprobs.narrow(0, begin, length)
          .copy_(logits.gather(-1, targets.narrow(0, begin, length).unsqueeze(-1)).squeeze(-1) - chunk_lse);
      if (with_entropy) {
        mean_logit.narrow(0, begin, length).copy_(((logits - chunk_lse.unsqueeze(-1)).exp_() * logits).sum(-1));
      }
    }
    ctx->save_for_backward({hidden, weight, targets, lse, mean_logit});
    ctx->saved_data["temperature"] = temperature;
    ctx->saved_data["chunk"] = chunk;
    if (!with_entropy) return {logprobs};
    return {logprobs, lse - mean_logit};
  }

  // Over each chunk's recomputed logits z, with p = softmax(z):
  //   d logprob / dz = onehot(target) - p;   d entropy / dz = -p (z - E_p[z]).
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &hidden = saved[0], &weight = saved[1], &targets = saved[2], &lse = saved[3],
                     &mean_logit = saved[4];
    const double temperature = ctx->saved_data["temperature"].toDouble();
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const at::Tensor& grad_logprobs = grads[0];                                  // [N] or undefined
    const at::Tensor grad_entropy = grads.size() > 1 ? grads[1] : at::Tensor();  // [N] or undefined
    // In the forward's precision, whatever autocast the caller's backward runs under.
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    at::Tensor grad_hidden = at::empty_like(hidden);
    at::Tensor grad_weight = at::zeros(weight.sizes(), weight.options().dtype(wide(weight.scalar_type())));
    for (int64_t begin = 0; begin < hidden.size(0); begin += chunk) {
      const int64_t length = std::min(chunk, hidden.size(0) - begin);
      const at::Tensor h = hidden.narrow(0, begin, length);
      at::Tensor logits = chunk_logits(h, weight, temperature);  // [n, V]
      // p, which becomes the gradient in place; the entropy's term p (z - E_p[z]) g takes the
      // logits' place: two [n, V] tensors live, as with the log-probabilities alone.
      at::Tensor d_logits = (logits - lse.narrow(0, begin, length).unsqueeze(-1)).exp_();
      if (grad_entropy.defined()) {
        logits.sub_(mean_logit.narrow(0, begin, length).unsqueeze(-1))
            .mul_(d_logits)
            .mul_(grad_entropy.narrow(0, begin, length).unsqueeze(-1));
      }
      if (grad_logprobs.defined()) {
        const at::Tensor g = grad_logprobs.narrow(0, begin, length).unsqueeze(-1);  // [n, 1]
        d_logits.mul_(-g).scatter_add_(-1, targets.narrow(0, begin, length).unsqueeze(-1), g);
      } else {
        d_logits.zero_();
      }
      if (grad_entropy.defined()) d_logits.sub_(logits);
      d_logits.div_(temperature);
      grad_hidden.narrow(0, begin, length).copy_(d_logits.to(weight.scalar_type()).mm(weight));
      grad_weight.addmm_(d_logits.t(), h.to(grad_weight.scalar_type()));
    }
    return {grad_hidden, grad_weight.to(weight.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }

  // [n, C] x [V, C] -> [n, V] logits over the temperature, widened for the softmax.
  static at::Tensor chunk_logits(const at::Tensor& h, const at::Tensor& weight, double temperature) {
    at::Tensor logits = h.mm(weight.t()).to(wide(h.scalar_type()));
    return temperature == 1.0 ? logits : logits.div_(temperature);
  }
};

}  // namespace

TokenLogprobs chunked_logprobs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                               double temperature, int64_t chunk_tokens, bool with_entropy) {
  const auto out = ChunkedLogprobs::apply(hidden, weight, targets, temperature, chunk_tokens, with_entropy);
  return {out[0], with_entropy ? out[1] : at::Tensor()};
}

}  // namespace fsdpp
