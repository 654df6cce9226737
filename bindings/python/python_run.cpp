// A Run driven from Python: each call's checks, its agreement over the ranks, and the call
// made with the GIL released.
#include "bindings/python/python_run.h"

#include "bindings/lua/policy.h"
#include "bindings/python/inputs.h"
#include "core/dtype.h"
#include "core/log.h"
#include "distributed/comm.h"
#include "io/sharded_checkpoint.h"
#include "models/kv_cache.h"

#include <ATen/Parallel.h>
#include <torch/python.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <string_view>

namespace py = pybind11;

namespace fsdpp {

namespace {

// The units compute in their plan's precision (precision{...}): a forward called under
// torch.autocast would otherwise cast inside them, and leave a backward outside it products of
// mixed dtypes.
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard excluded{c10::autocast_dispatch_keyset};
};

// The default generators' states (the CPU's and each accelerator's, those torch.manual_seed
// sets), taken at construction and put back by restore().
class DefaultGenerators {
 public:
  DefaultGenerators() {
    keep(at::globalContext().defaultGenerator(c10::DeviceType::CPU));
    if (const auto type = at::getAccelerator()) {
      const auto devices = at::globalContext().getAcceleratorHooksInterface(type).deviceCount();
      for (c10::DeviceIndex i = 0; i < static_cast<c10::DeviceIndex>(devices); ++i) {
        keep(at::globalContext().defaultGenerator(c10::Device(*type, i)));
      }
    }
  }
  void restore() {
    for (auto& [generator, state] : kept_) {
      const std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(state);
    }
  }

 private:
  void keep(at::Generator generator) {
    const std::lock_guard<std::mutex> lock(generator.mutex());
    kept_.emplace_back(generator, generator.get_state());
  }
  std::vector<std::pair<at::Generator, at::Tensor>> kept_;
};

}  // namespace

GradReduction grad_reduction_named(const std::string& name) {
  if (name == "mean") return GradReduction::mean;
  if (name == "sum") return GradReduction::sum;
  throw UserError("grad_reduction: '" + name + "' is not one of mean, sum");
}

template <typename Work>
std::invoke_result_t<Work&> PythonRun::exclusively(Work&& work) {
  py::gil_scoped_release released;
  const auto call = run_->begin_call();
  if (out_of_step_) throw UserError(*out_of_step_);
  try {
    if (run_->settle_backward() && world_size() > 1) {
      fall_out_of_step("a backward through the units ended in an exception");
      throw UserError(*out_of_step_);
    }
    return work();
  } catch (const EveryRankError&) {  // every rank raised it: they stay in step
    throw;
  } catch (const std::exception& e) {
    if (world_size() > 1 && !out_of_step_) fall_out_of_step(e.what());
    throw;
  }
}

void PythonRun::fall_out_of_step(const std::string& error) {
  out_of_step_ = "rank " + std::to_string(rank()) + " is out of step with the other ranks since an error not " +
                 "every rank raised (" + first_line(error) + "): build a new fsdpp.Run on every rank";
  log_warn(*out_of_step_);
}

template <typename Check>
void PythonRun::agree_on_inputs(const std::string& call, Check&& check) {
  std::optional<std::string> refused;
  try {
    check();
  } catch (const std::exception& e) {
    // The host allocator's refusal is said as the binary says it, without LibTorch's words of
    // its own source line.
    const auto host = host_allocation_refused(e.what());
    refused = host ? call + ": out of host memory: " + first_line(*host) : first_line(e.what());
  }
  agree_on_refusal(call, refused.has_value());
  if (refused) throw EveryRankError(*refused);
}

namespace {

// The calls whose inputs the ranks agree on, each by its place here: a rank that is in
// another call than the others learns which one.
constexpr std::array<std::string_view, 11> kAgreedCalls = {
    "run.model", "run.model.hidden_states", "run.model.logprobs", "run.model.generate", "step",
    "load_weights", "save", "load", "offload", "full_weights", "backward"};

int64_t call_number(std::string_view call) {
  const auto found = std::find(kAgreedCalls.begin(), kAgreedCalls.end(), call);
  TORCH_CHECK(found != kAgreedCalls.end(), "agreement of a call not in kAgreedCalls: ", call);
  return found - kAgreedCalls.begin();
}

}  // namespace

void PythonRun::agree_on_refusal(const std::string& call, bool refused_here) {
  const int world = run_->comm().size(), rank = run_->comm().rank();
  if (world == 1) return;
  // Row 0: which ranks refused; row 1: the call each rank is in. One all-reduce carries both.
  at::Tensor agreed = at::zeros({2, world}, at::kLong);  // [2, world]
  agreed[0][rank] = refused_here ? 1 : 0;
  agreed[1][rank] = call_number(call);
  run_->comm().all_reduce_sum(agreed);
  const auto seen = agreed.accessor<int64_t, 2>();
  for (int r = 0; r < world; ++r) {
    if (seen[1][r] != seen[1][rank]) {
      throw EveryRankError(call + ": rank " + std::to_string(r) + " is in " + std::string(kAgreedCalls.at(seen[1][r])) +
                           " where this rank is in " + call + ": every rank calls the run in the same order; the " +
                           "calls raise, and the run goes on");
    }
  }
  for (int r = 0; r < world && !refused_here; ++r) {
    if (seen[0][r] > 0) {
      throw EveryRankError(call + ": rank " + std::to_string(r) + "'s inputs were refused (its error says why); every "
                           "rank raises, and the run goes on");
    }
  }
}

namespace {
std::string rate_text(std::optional<double> lr) {
  if (!lr) return "none (the [scheduler]'s)";
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", *lr);
  return text;
}
}  // namespace

void PythonRun::agree_on_rate(std::optional<double> lr) {
  agree_on_inputs("step", [&] {
    if (lr && !(*lr >= 0.0 && *lr <= 1e6)) throw UserError("step: lr must be a number in [0, 1e6], got " + rate_text(lr));
  });
  const std::vector<std::string> rates = run_->comm().all_gather_texts(rate_text(lr));
  for (size_t r = 1; r < rates.size(); ++r) {
    if (rates[r] != rates[0]) {
      throw EveryRankError("step: rank " + std::to_string(r) + " gave lr " + rates[r] + " and rank 0 " + rates[0] +
                           ": every rank steps at one rate");
    }
  }
}

PythonRun::PythonRun(const std::string& path, const std::vector<std::string>& overrides,
                     const std::string& grad_reduction, bool frozen)
    : config_(RunConfig::load(path, overrides, "overrides:")),
      reduction_(grad_reduction_named(grad_reduction)),
      schedule_(config_.scheduler, config_.optimizer.lr, config_.train.steps) {
  config_.data.train.clear();  // the loop brings its own rows: [data] is not read
  // A reference model is the one its [model] path names, whatever checkpoint the trained run
  // beside it resumes from the same run file.
  if (frozen) config_.checkpoint.resume = {};
  config_.check_paths();
  if (config_.train.threads > 0) at::set_num_threads(static_cast<int>(config_.train.threads));
  // The run seeds torch's generators per rank ([model] init_seed + rank), as the binary wants;
  // a Python loop's are its own (its sampling draws from them), so they are put back. A
  // resume below, and load(), set them to the checkpoint's, as documented.
  DefaultGenerators loop_generators;
  // A frozen run's policy sees ctx.training false: shard_size = "auto" then keeps a small
  // reference model whole on every rank, as the seed's rule does.
  run_ = std::make_unique<Run>(
      config_,
      [this, frozen](CausalLM& model, int world, int rank) {
        return run_configured_policy(config_.policy, model, world, rank, /*training=*/!frozen);
      },
      frozen ? RunWeights::frozen : RunWeights::trained);
  loop_generators.restore();
  run_->divide_gradients_by(reduction_ == GradReduction::mean ? static_cast<double>(run_->comm().size()) : 1.0);
  // A backward is every rank's, as a forward is: a rank whose loop skipped one meets the
  // others' agreement with its next call's, and both raise.
  run_->check_backwards_with([this] { agree_on_refusal("backward", false); });
  if (frozen) return;
  const ResumePoint resumed = run_->resume();
  steps_ = resumed.step;
  skipped_steps_ = resumed.state.skipped_steps;
  loop_state_ = resumed.loop_state;
}

at::Tensor PythonRun::forward(const at::Tensor& input_ids, const std::optional<at::Tensor>& position_ids,
                              const std::optional<at::Tensor>& document_offsets, const VisionArguments& vision) {
  return model_output("run.model", /*hidden=*/false, input_ids, position_ids, document_offsets, vision);
}

at::Tensor PythonRun::hidden_states(const at::Tensor& input_ids, const std::optional<at::Tensor>& position_ids,
                                    const std::optional<at::Tensor>& document_offsets,
                                    const VisionArguments& vision) {
  return model_output("run.model.hidden_states", /*hidden=*/true, input_ids, position_ids, document_offsets, vision);
}

at::Tensor PythonRun::model_output(const std::string& call, bool hidden, const at::Tensor& input_ids,
                                   const std::optional<at::Tensor>& position_ids,
                                   const std::optional<at::Tensor>& document_offsets, const VisionArguments& vision) {
  return exclusively([&] {
    RowLayout layout;
    VisionInputs images;
    agree_on_inputs(call, [&] {
      check_token_ids("input_ids", input_ids, vocab_size());
      layout = checked_layout(input_ids, position_ids, document_offsets);
      images = checked_vision(run_->model().config(), input_ids, layout, vision);
    });
    const NoAutocast own_precision;
    return hidden ? run_->hidden_states(input_ids, layout, images) : run_->forward(input_ids, layout, images);
  });
}

std::vector<at::Tensor> PythonRun::logprobs(const at::Tensor& input_ids, const at::Tensor& targets,
                                            double temperature, const std::optional<at::Tensor>& position_ids,
                                            const std::optional<at::Tensor>& document_offsets,
                                            const VisionArguments& vision, bool entropy) {
  return exclusively([&] {
    RowLayout layout;
    VisionInputs images;
    agree_on_inputs("run.model.logprobs", [&] {
      check_logprobs_inputs(input_ids, targets, temperature, vocab_size());
      layout = checked_layout(input_ids, position_ids, document_offsets);
      images = checked_vision(run_->model().config(), input_ids, layout, vision);
    });
    const NoAutocast own_precision;
    const TokenLogprobs out = run_->logprobs(input_ids, targets, temperature, layout, images, entropy);
    return entropy ? std::vector<at::Tensor>{out.logprobs, out.entropy} : std::vector<at::Tensor>{out.logprobs};
  });
}

at::Tensor PythonRun::generate(const at::Tensor& input_ids, const std::optional<at::Tensor>& attention_mask,
                               const VisionArguments& vision, const GenerationOptions& options,
                               const OptionNames& names) {
  return exclusively([&] {
    at::Tensor kept;
    VisionInputs images;
    agree_on_inputs("run.model.generate", [&] {
      kept = checked_generation(input_ids, attention_mask, options, vocab_size(), names);
      const RowLayout layout{.offsets = kept.defined() ? left_padded_documents(kept) : at::Tensor()};
      images = checked_vision(run_->model().config(), input_ids, layout, vision);
    });
    const NoAutocast own_precision;
    return run_->generate(input_ids, kept, images, options);
  });
}

void PythonRun::refuse_inputs(const std::string& call) {
  exclusively([&] { agree_on_refusal(call, true); });
}

double PythonRun::scheduled_lr() const { return schedule_.at(steps_ + 1); }

std::pair<double, bool> PythonRun::step(std::optional<double> lr) {
  const UpdateFigures figures = exclusively([&] {
    run_->check_trains("step");
    agree_on_rate(lr);
    if (!lr && steps_ >= config_.train.steps && scheduled_lr() == 0.0) {
      // The schedule spans [train] steps: past them a decaying one stays at its end, and where
      // that is 0 (min_lr_ratio's default) the steps would update nothing without a word. Every
      // rank has taken as many steps as the others, so all raise alike.
      throw EveryRankError("step: the run has taken its [train] steps = " + std::to_string(config_.train.steps) +
                           ", where its [scheduler] decays to a learning rate of 0; set [train] steps to the "
                           "updates the loop makes (or [scheduler] min_lr_ratio above 0), or give step(lr=...)");
    }
    const UpdateFigures applied = run_->apply_gradients(lr.value_or(scheduled_lr()));
    if (applied.stepped) {
      ++steps_;
      ++weights_version_;
    } else {
      ++skipped_steps_;
    }
    return applied;
  });
  return {figures.grad_norm, figures.stepped};
}

std::vector<std::pair<std::string, at::Tensor>> PythonRun::full_weights(int64_t unit, const std::string& dtype) {
  return exclusively([&] {
    at::ScalarType type = at::kFloat;
    // Agreed at the first unit, which every rank's iteration starts with, package refusals too.
    const auto check = [&] {
      if (unit < 0 || unit >= units()) throw UserError("full_weights: no unit " + std::to_string(unit));
      type = parse_dtype(dtype);
    };
    if (unit == 0) {
      agree_on_inputs("full_weights", check);
    } else {
      check();
    }
    return run_->full_weights(static_cast<size_t>(unit), type);
  });
}

bool PythonRun::load_weights(const std::vector<std::pair<std::string, at::Tensor>>& weights) {
  return exclusively([&] {
    agree_on_inputs("load_weights", [&] { run_->check_weights(weights); });
    // Each rank keeps its own rows of what it is given, so ranks given other tensors would
    // each load their part of another one: the names, dtypes and shapes must agree.
    std::string given = weights.empty() ? "no more pairs" : "";
    for (const auto& [name, value] : weights) {
      given += "'" + name + "' " + std::string(c10::toString(value.scalar_type())) + " " + c10::str(value.sizes());
    }
    const std::vector<std::string> all = run_->comm().all_gather_texts(given);
    for (size_t r = 1; r < all.size(); ++r) {
      if (all[r] != all[0]) {
        throw EveryRankError("load_weights: rank " + std::to_string(r) + " gave " + all[r] + " where rank 0 gave " +
                             all[0] + ": every rank gives the same pairs, in the same order");
      }
    }
    if (weights.empty()) return false;
    ++weights_version_;
    run_->load_weights(weights);
    return true;
  });
}

std::string PythonRun::save(const std::optional<std::string>& root, const std::string& loop_state) {
  const std::filesystem::path dir = root ? *root : config_.checkpoint.dir;
  exclusively([&] {
    run_->check_trains("save");
    // Each rank looks at its own file system: ranks on nodes of their own may see otherwise.
    agree_on_inputs("save", [&] {
      if (root && root->empty()) throw UserError("save: the directory is an empty path");
      // The binary leaves a step saved twice as it is; here a load() may have rewound the step
      // count under a directory that holds the older checkpoint of that step.
      if (std::filesystem::exists(checkpoint_path(dir, steps_))) {
        throw UserError("save: " + checkpoint_path(dir, steps_).string() + " exists already; save to another "
                        "directory or remove it");
      }
    });
    run_->save(steps_, ClientState{.skipped_steps = skipped_steps_}, dir, loop_state);
  });
  return checkpoint_path(dir, steps_).string();
}

void PythonRun::load(const std::string& path) {
  exclusively([&] {
    agree_on_inputs("load", [] {});  // the package's refusals of a path, on any rank, meet this
    ++weights_version_;  // a load that fails part-way has changed some of them too
    const ResumePoint point = run_->load(path);
    run_->zero_grad();  // gradients of the weights before the load are of none the run now holds
    steps_ = point.step;
    skipped_steps_ = point.state.skipped_steps;
    loop_state_ = point.loop_state;
  });
}

void PythonRun::offload(const std::vector<std::string>& what) {
  exclusively([&] {
    Run::Offloaded moved;
    agree_on_inputs("offload", [&] {
      for (const auto& name : what) {
        if (name == "params") moved.params = true;
        else if (name == "grads") moved.grads = true;
        else if (name == "optimizer") moved.optimizer = true;
        else throw UserError("offload: '" + name + "' is not one of params, grads, optimizer");
      }
      if (!moved.params && !moved.grads && !moved.optimizer) {
        throw UserError("offload: name at least one of params, grads, optimizer");
      }
    });
    run_->offload(moved);
  });
}

void PythonRun::reload() {
  exclusively([&] { run_->reload(); });
}

void PythonRun::zero_grad() {
  exclusively([&] { run_->zero_grad(); });
}

void PythonRun::set_training(bool training) {
  exclusively([&] { run_->model().train(training); });
}

}  // namespace fsdpp
