// A run's forwards for a caller that owns the loss (the Python API): logits, final hidden
// states or per-token log-probabilities with autograd through the units, the mixture-of-experts
// routing balance each forward with autograd owes its backward, and the loss scale applied to
// what the caller differentiates; and the waits that keep a caller's calls off a backward in
// flight.
#include "run/run.h"

#include "core/device.h"
#include "core/error.h"
#include "fsdp/fsdp_state.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function_hook.h>

#include <algorithm>

namespace fsdpp {

namespace {

// A copy of `t` in `dtype` whose gradient backward multiplies by `factor` before casting it
// back to t's dtype: a caller's loss that is not multiplied by the loss scale gets its
// gradient scaled in float32, before the cast to float16 could flush it to zero. A copy, not
// a view, so that the caller may change it in place.
struct ScaleGradient : public torch::autograd::Function<ScaleGradient> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& t, at::ScalarType dtype,
                            double factor) {
    ctx->saved_data["factor"] = factor;
    ctx->saved_data["dtype"] = static_cast<int64_t>(t.scalar_type());
    return t.to(dtype, /*non_blocking=*/false, /*copy=*/true);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {(grads[0] * ctx->saved_data["factor"].toDouble()).to(dtype), at::Tensor(), at::Tensor()};
  }
};

// Gathers the root unit again before the chunked log-probabilities' backward reads the head's
// weight: once per run of that node, whichever of its outputs the loss used.
struct GatherRootFirst : public torch::autograd::FunctionPreHook {
  explicit GatherRootFirst(FsdpUnit* root) : root(root) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    root->pre_backward();
    return grads;
  }
  FsdpUnit* root;
};

}  // namespace

bool Run::settle_backward() { return fsdp_->settle_backward(); }

std::unique_lock<std::mutex> Run::begin_call() { return fsdp_->begin_call(); }

void Run::divide_gradients_by(double divisor) { fsdp_->set_gradient_divisor(divisor); }

void Run::check_backwards_with(std::function<void()> check) { fsdp_->set_backward_check(std::move(check)); }

at::Tensor Run::forward(const at::Tensor& input_ids, const RowLayout& layout, const VisionInputs& vision) {
  check_loaded("forward", /*params_only=*/true);
  check_balance_consumed("forward");
  const at::Tensor input = to_device(input_ids, device_);
  const at::Tensor logits = scaled_output(!vision.empty() ? model()(input, vision.to(device_), layout)
                                          : layout.empty() ? model()(input)
                                                           : model()(input, layout));
  balance_experts(logits);
  return logits;
}

void Run::check_balance_consumed(const char* what) const {
  // The load-balancing gradient lives in one buffer per layer, which a forward with autograd
  // refills; sampling runs without autograd, and sums no routing. A forward whose output is
  // gone (dropped, or detached) will have no backward to wait for.
  if (experts_ && at::GradMode::is_enabled() && balanced_after_ && *balanced_after_ == fsdp_->backwards_ended() &&
      !balanced_graph_.expired()) {
    throw EveryRankError(std::string(what) + ": a mixture-of-experts model's forward with autograd before the "
                         "backward of the previous one, whose load-balancing gradient it would replace: backward each forward first, "
                         "forward the rows in one call, or sample under torch.no_grad()");
  }
}

void Run::balance_experts(const at::Tensor& output) {
  if (experts_ && at::GradMode::is_enabled()) {
    balanced_after_ = fsdp_->backwards_ended();
    balanced_graph_ = output.grad_fn();
    // A retained graph may be backpropagated again after a later forward refilled the buffers
    // it reads: refused, where it would take that forward's load-balancing gradient.
    const int64_t forward = ++balanced_forwards_;
    if (output.requires_grad()) {
      output.register_hook([this, forward](const at::Tensor&) {
        if (forward != balanced_forwards_) {
          throw UserError("backward: through a mixture-of-experts model's forward made before the latest forward "
                          "with autograd, which replaced its load-balancing gradient: backward each forward before "
                          "the next");
        }
      });
    }
    experts_->micro_batch_loss(*model().routing(), *comm_, /*micro_batches=*/1,
                               fsdp_->gradient_divisor() * (scaler_ ? scaler_->scale() : 1.0));
  }
}

at::Tensor Run::scaled_output(const at::Tensor& output) const {
  if (!scaler_ || !at::GradMode::is_enabled()) return output;
  const at::ScalarType dtype = at::isReducedFloatingType(output.scalar_type()) ? at::kFloat : output.scalar_type();
  return ScaleGradient::apply(output, dtype, scaler_->scale());
}

at::Tensor Run::hidden_states(const at::Tensor& input_ids, const RowLayout& layout, const VisionInputs& vision) {
  check_loaded("hidden_states", /*params_only=*/true);
  check_balance_consumed("hidden_states");
  const at::Tensor hidden =
      scaled_output(model()(to_device(input_ids, device_), FinalHidden{layout, vision.to(device_)}));  // [B, T, C]
  balance_experts(hidden);
  return hidden;
}

TokenLogprobs Run::logprobs(const at::Tensor& input_ids, const at::Tensor& targets, double temperature,
                            const RowLayout& layout, const VisionInputs& vision, bool with_entropy) {
  check_loaded("logprobs", /*params_only=*/true);
  if (model().config().num_labels > 0) {
    throw EveryRankError("logprobs: " + model().class_name() + " scores tokens with its score head, and gives no "
                         "token log-probabilities: read run.model's scores [B, T, labels]");
  }
  if (!head_in_root_) {
    throw EveryRankError("logprobs: the output head must stay in the root unit, gathered until backward: set "
                         "[policy.options] fused_linear_logprob = true");
  }
  if (model().output_head_adapted()) throw EveryRankError("logprobs: the output head carries a LoRA adapter");
  check_balance_consumed("logprobs");
  const at::Tensor input = to_device(input_ids, device_);
  const at::Tensor hidden = model()(input, FinalHidden{layout, vision.to(device_)});  // [B, T, C]
  const int64_t rows = hidden.size(0), tokens = hidden.size(1);
  // About 64 MiB of float32 logits live at a time.
  const int64_t chunk = std::max<int64_t>(64, (int64_t{16} << 20) / model().config().vocab_size);
  const TokenLogprobs flat = chunked_logprobs(hidden.reshape({rows * tokens, -1}), model().output_head_weight(),
                                              to_device(targets, device_).reshape({-1}), temperature, chunk,
                                              with_entropy);  // [B * T] each
  // Backward reads the head's weight before the hidden states' gradient reaches the root
  // unit's own hook: a step or an offload between this forward and its backward resharded
  // it, so the root gathers again first, as a layer's unit does for its own backward.
  if (flat.logprobs.requires_grad()) {
    flat.logprobs.grad_fn()->add_pre_hook(std::make_unique<GatherRootFirst>(fsdp_->units().back().get()));
  }
  TokenLogprobs out{scaled_output(flat.logprobs.view({rows, tokens}))};
  if (with_entropy) out.entropy = scaled_output(flat.entropy.view({rows, tokens}));
  balance_experts(out.logprobs);
  return out;
}

}  // namespace fsdpp
