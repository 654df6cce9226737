// A run's generation: each row of a prompt continued token by token over a cache of its keys
// and values, every rank stepping together (each step's forward gathers the units).
#include "run/run.h"

#include "core/device.h"
#include "core/error.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace fsdpp {

namespace {

// What every rank said of a step, read back in the step's one wait.
struct StepAgreement {
  int64_t broken_ranks = 0;  // ranks whose logits held NaN or inf
  int64_t going_ranks = 0;   // ranks with rows still to continue
  bool going_here = false;
};

// Each rank's two flags (device scalars) in its row of a [world, 2] table that a sum over the
// ranks fills in: one collective and one read a step, where a flag each would take two.
StepAgreement agree_on_step(Comm& comm, const at::Tensor& broken, const at::Tensor& going) {
  at::Tensor table = at::zeros({comm.size(), 2}, at::TensorOptions(at::kLong).device(broken.device()));
  table[comm.rank()].copy_(at::stack({broken, going}));
  if (comm.size() > 1) comm.all_reduce_sum(table);
  const at::Tensor host = table.cpu();  // [world, 2]
  const at::Tensor counts = host.sum(0);
  return {counts[0].item<int64_t>(), counts[1].item<int64_t>(), host[comm.rank()][1].item<int64_t>() != 0};
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
  bool going_here = true;  // rows of this rank still to continue, and tokens still to add
  const at::Tensor no = at::zeros({}, at::TensorOptions(at::kBool).device(device_));
  for (int64_t step = 0; step < steps; ++step) {
    const at::Tensor logits =
        model()(tokens, GenerationStep{&cache, step_kept, step == 0 ? vision.to(device_) : VisionInputs{}});  // [B, V]
    at::Tensor broken = no, going = no;
    if (going_here) {
      // A row of NaN or inf (weights that diverged) has no distribution to draw from: it draws
      // from zeros instead, and every rank stops below, together, on what it found.
      const at::Tensor finite = logits.isfinite().all(-1, /*keepdim=*/true);  // [B, 1]
      const at::Tensor drawn = next_tokens(at::where(finite, logits, at::zeros({}, logits.options())), options);
      const at::Tensor next = at::where(ended, options.pad, drawn);  // [B]
      pieces.push_back(next.unsqueeze(1));
      tokens = next.unsqueeze(1);
      if (eos.numel() > 0) ended |= at::isin(next, eos);
      broken = finite.logical_not().any();
      going = step + 1 == options.max_new_tokens ? no : (eos.numel() > 0 ? ended.logical_not().any() : no.logical_not());
    } else {
      tokens = at::full_like(tokens.narrow(1, 0, 1), options.pad);  // steps that add nothing
    }
    step_kept = at::ones_like(tokens, at::kBool);
    const StepAgreement agreed = agree_on_step(*comm_, broken, going);
    if (agreed.broken_ranks > 0) {
      throw EveryRankError("generate: the logits hold NaN or inf at new token " + std::to_string(step + 1) + " on " +
                           std::to_string(agreed.broken_ranks) + " rank(s) of " + std::to_string(comm_->size()) +
                           ": the weights are not finite");
    }
    going_here = agreed.going_here;
    // A rank whose rows ended still steps (its forwards join the units' gathers) until every
    // rank's have.
    if (agreed.going_ranks == 0) break;
  }
  return at::cat(pieces, 1).to(prompt.device());  // [B, T + added]
}

}  // namespace fsdpp
