// A run's generation: each row of a prompt continued token by token over a cache of its keys
// and values, every rank stepping together (each step's forward gathers the units).
#include "run/run.h"

#include "core/device.h"
#include "core/error.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace fsdpp {

namespace {

// How many ranks say `here`: every rank learns of a state any one is in.
int64_t ranks_where(Comm& comm, bool here) {
  if (comm.size() == 1) return here ? 1 : 0;
  at::Tensor count = at::full({1}, here ? 1 : 0, at::TensorOptions(at::kLong).device(comm.device()));
  comm.all_reduce_sum(count);
  return count.item<int64_t>();
}

}  // namespace

at::Tensor Run::generate(const at::Tensor& prompt, const at::Tensor& kept, const VisionInputs& vision,
                         const GenerationOptions& options) {
  check_loaded("generate", /*params_only=*/true);
  if (model().config().num_labels > 0) {
    throw EveryRankError("generate: " + model().class_name() + " scores tokens with its score head, and predicts none");
  }
  // The longest generation any rank asked for sizes every rank's cache and bounds the steps.
  int64_t steps = options.max_new_tokens;
  for (const std::string& asked : comm_->all_gather_texts(std::to_string(options.max_new_tokens))) {
    steps = std::max<int64_t>(steps, std::stoll(asked));
  }
  KvCache cache = model().generation_cache(prompt.size(1) + steps);
  const at::NoGradGuard no_grad;
  at::Tensor tokens = to_device(prompt, device_);  // [B, T], then [B, 1] a step
  at::Tensor step_kept = kept.defined() ? to_device(kept, device_).to(at::kBool) : at::ones_like(tokens, at::kBool);
  const at::Tensor eos = at::tensor(options.eos, at::kLong).to(device_);
  at::Tensor ended = at::zeros({tokens.size(0)}, at::TensorOptions(at::kBool).device(device_));  // [B]
  std::vector<at::Tensor> pieces{tokens};  // the prompt, then each step's tokens
  bool done_here = false;  // every row of this rank ended, or it added all it asked for
  for (int64_t step = 0; step < steps; ++step) {
    const at::Tensor logits =
        model()(tokens, GenerationStep{&cache, step_kept, step == 0 ? vision.to(device_) : VisionInputs{}});  // [B, V]
    // Logits of NaN or inf (weights that diverged) have no distribution to draw from: every rank
    // stops here together, where the draw would fail on one rank alone.
    if (const int64_t broken = ranks_where(*comm_, !done_here && !logits.isfinite().all().item<bool>())) {
      throw EveryRankError("generate: the logits hold NaN or inf at new token " + std::to_string(step + 1) + " on " +
                           std::to_string(broken) + " rank(s) of " + std::to_string(comm_->size()) +
                           ": the weights are not finite");
    }
    if (!done_here) {
      const at::Tensor next = at::where(ended, options.pad, next_tokens(logits, options));  // [B]
      pieces.push_back(next.unsqueeze(1));
      tokens = next.unsqueeze(1);
      if (eos.numel() > 0) ended |= at::isin(next, eos);
      done_here = step + 1 == options.max_new_tokens || (eos.numel() > 0 && ended.all().item<bool>());
    } else {
      tokens = at::full_like(tokens.narrow(1, 0, 1), options.pad);  // steps that add nothing
    }
    step_kept = at::ones_like(tokens, at::kBool);
    // A rank whose rows ended still steps (its forwards join the units' gathers) until every
    // rank's have.
    if (ranks_where(*comm_, !done_here) == 0) break;
  }
  return at::cat(pieces, 1).to(prompt.device());  // [B, T + added]
}

}  // namespace fsdpp
