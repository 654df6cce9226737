// The Python extension _fsdpp: a Run driven from Python, one rank per process, for loops
// that bring their own rows and loss (RL: log-probabilities, ratios, KL). It is the run the
// binary builds, from the same run file and policies; fsdpp/__init__.py is its Python face.
// Every UserError becomes fsdpp.Error, one line naming the file, key or rank.
#include "bindings/lua/policy.h"
#include "bindings/python/inputs.h"
#include "core/cpu_kernels.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
#include "distributed/comm.h"
#include "io/sharded_checkpoint.h"
#include "metrics/op_count.h"
#include "optim/lr_schedule.h"
#include "run/run.h"

#include <ATen/Parallel.h>
#include <torch/python.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace py = pybind11;

namespace fsdpp {

namespace {

// How gradients summed over the ranks become the step's: averaged (as DDP and FSDP2 do) or
// left summed.
enum class GradReduction { mean, sum };

GradReduction grad_reduction_named(const std::string& name) {
  if (name == "mean") return GradReduction::mean;
  if (name == "sum") return GradReduction::sum;
  throw UserError("grad_reduction: '" + name + "' is not one of mean, sum");
}

// The units compute in their plan's precision (precision{...}): a forward called under
// torch.autocast would otherwise cast inside them, and leave a backward outside it products of
// mixed dtypes.
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard excluded{c10::autocast_dispatch_keyset};
};

class PythonRun {
 public:
  PythonRun(const std::string& path, const std::vector<std::string>& overrides, const std::string& grad_reduction)
      : config_(RunConfig::load(path, overrides, "overrides:")),
        reduction_(grad_reduction_named(grad_reduction)),
        schedule_(config_.scheduler, config_.optimizer.lr, config_.train.steps) {
    config_.data.train.clear();  // the loop brings its own rows: [data] is not read
    config_.check_paths();
    if (config_.train.threads > 0) at::set_num_threads(static_cast<int>(config_.train.threads));
    run_ = std::make_unique<Run>(config_, [this](CausalLM& model, int world, int rank) {
      return run_configured_policy(config_.policy, model, world, rank);
    });
    const ResumePoint resumed = run_->resume();
    steps_ = resumed.step;
    skipped_steps_ = resumed.state.skipped_steps;
  }

  // Logits [B, T, V] of input_ids [B, T] int64 (RoPE positions from `position_ids` [B, T];
  // documents packed into the rows from `document_offsets` [S + 1], offsets into the rows
  // read one after another).
  at::Tensor forward(const at::Tensor& input_ids, const std::optional<at::Tensor>& position_ids,
                     const std::optional<at::Tensor>& document_offsets) {
    return exclusively([&] {
      RowLayout layout;
      agree_on_inputs("run.model", [&] {
        check_token_ids("input_ids", input_ids, vocab_size());
        layout = checked_layout(input_ids, position_ids, document_offsets);
      });
      const NoAutocast own_precision;
      return run_->forward(input_ids, layout, grad_divisor());
    });
  }

  // Per-token log-probabilities [B, T] of targets [B, T] (the token each position predicts)
  // at `temperature`, chunked: no [B, T, V] logits are held (Run::logprobs).
  at::Tensor logprobs(const at::Tensor& input_ids, const at::Tensor& targets, double temperature,
                      const std::optional<at::Tensor>& position_ids, const std::optional<at::Tensor>& document_offsets) {
    return exclusively([&] {
      RowLayout layout;
      agree_on_inputs("run.model.logprobs", [&] {
        check_logprobs_inputs(input_ids, targets, temperature, vocab_size());
        layout = checked_layout(input_ids, position_ids, document_offsets);
      });
      const NoAutocast own_precision;
      return run_->logprobs(input_ids, targets, temperature, layout, grad_divisor());
    });
  }

  // Where the package refused this rank's arguments to `call` before they reached the run:
  // tells the other ranks, as agree_on_inputs does, and returns for the package to raise its
  // own error.
  void refuse_inputs(const std::string& call) {
    exclusively([&] { agree_on_refusal(call, true); });
  }

  // One optimizer step from the gradients the backward calls since zero_grad left:
  // (global gradient norm before clipping, whether the update was applied).
  py::tuple step() {
    const UpdateFigures figures = exclusively([&] {
      // The schedule spans [train] steps: past them a decaying one stays at its end, and where
      // that is 0 (min_lr_ratio's default) the steps would update nothing without a word. Every
      // rank has taken as many steps as the others, so all raise alike.
      if (steps_ >= config_.train.steps && schedule_.at(steps_ + 1) == 0.0) {
        throw EveryRankError("step: the run has taken its [train] steps = " + std::to_string(config_.train.steps) +
                             ", where its [scheduler] decays to a learning rate of 0; set [train] steps to the "
                             "updates the loop makes (or [scheduler] min_lr_ratio above 0)");
      }
      const UpdateFigures applied = run_->apply_gradients(schedule_.at(steps_ + 1), grad_divisor());
      if (applied.stepped) ++steps_;
      else ++skipped_steps_;
      return applied;
    });
    return py::make_tuple(figures.grad_norm, figures.stepped);
  }

  // Unit `unit`'s weights gathered whole in `dtype` ("bfloat16", ...), LoRA merged.
  std::vector<std::pair<std::string, at::Tensor>> full_weights(int64_t unit, const std::string& dtype) {
    if (unit < 0 || unit >= units()) throw UserError("full_weights: no unit " + std::to_string(unit));
    const at::ScalarType type = parse_dtype(dtype);
    return exclusively([&] { return run_->full_weights(static_cast<size_t>(unit), type); });
  }

  // Saves the run at its step count as the binary saves it: a sharded checkpoint under `root`
  // (none: [checkpoint] dir; older ones rotated by keep and max_gb) that `fsdpp train` and
  // `fsdpp export` read, and that load() or [checkpoint] resume brings back at any world size.
  // Returns its path, as bytes: a name of no UTF-8 is the caller's to decode.
  py::bytes save(const std::optional<std::string>& root) {
    const std::filesystem::path dir = root ? *root : config_.checkpoint.dir;
    exclusively([&] {
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
      run_->save(steps_, ClientState{.skipped_steps = skipped_steps_}, dir);
    });
    return py::bytes(checkpoint_path(dir, steps_).string());
  }

  // Replaces the parameters, the optimizer's state and the step count with the checkpoint's.
  void load(const std::string& path) {
    exclusively([&] {
      agree_on_inputs("load", [] {});  // the package's refusals of a path, on any rank, meet this
      const ResumePoint point = run_->load(path);
      steps_ = point.step;
      skipped_steps_ = point.state.skipped_steps;
    });
  }

  // Moves the named state ("params", "grads", "optimizer") off the device until reload().
  void offload(const std::vector<std::string>& what) {
    Run::Offloaded moved;
    for (const auto& name : what) {
      if (name == "params") moved.params = true;
      else if (name == "grads") moved.grads = true;
      else if (name == "optimizer") moved.optimizer = true;
      else throw UserError("offload: '" + name + "' is not one of params, grads, optimizer");
    }
    if (!moved.params && !moved.grads && !moved.optimizer) {
      throw UserError("offload: name at least one of params, grads, optimizer");
    }
    exclusively([&] { run_->offload(moved); });
  }

  void reload() {
    exclusively([&] { run_->reload(); });
  }

  void zero_grad() {
    exclusively([&] { run_->zero_grad(); });
  }

  // Whether the model's forwards train (LoRA's dropout on) or only compute (off), as a torch
  // module's train() and eval() say: a loop samples and takes reference log-probabilities in
  // eval(), so that a PPO ratio starts at 1.
  void set_training(bool training) {
    exclusively([&] { run_->model().train(training); });
  }
  bool training() { return run_->model().is_training(); }
  int64_t units() const { return static_cast<int64_t>(run_->units()); }
  int rank() { return run_->comm().rank(); }
  int world_size() const { return run_->comm().size(); }
  int64_t steps() const { return steps_; }
  std::optional<double> loss_scale() const { return run_->loss_scale(); }
  std::string device() const { return run_->device().str(); }
  int64_t vocab_size() const { return run_->model().config().vocab_size; }

 private:
  // `work` on the run with the GIL released, so that the loop's other Python threads go on
  // meanwhile, and one call at a time: a second thread's call, or a backward another thread
  // begins, waits for the first to end, and a call waits for a backward another thread runs
  // (Run::begin_call). One that ended in an exception is put right (FsdpState::settle_backward).
  // Past an error of this rank's alone, a rank of a larger world is out of step with the others
  // (they wait in collectives it left, or would meet its next ones with theirs): its run
  // refuses every later call, naming that error, rather than pair collectives that differ.
  template <typename Work>
  std::invoke_result_t<Work&> exclusively(Work&& work) {
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

  void fall_out_of_step(const std::string& error) {
    out_of_step_ = "rank " + std::to_string(rank()) + " is out of step with the other ranks since an error not " +
                   "every rank raised (" + first_line(error) + "): build a new fsdpp.Run on every rank";
    log_warn(*out_of_step_);
  }

  // `check` of a call's inputs, agreed over the ranks before the call's first collective: an
  // input is a rank's own (its rows), and a rank that raised alone would leave the others in
  // collectives it never joins. Where any rank's check failed, every rank raises.
  template <typename Check>
  void agree_on_inputs(const std::string& call, Check&& check) {
    std::optional<std::string> refused;
    try {
      check();
    } catch (const std::exception& e) {
      refused = first_line(e.what());
    }
    agree_on_refusal(call, refused.has_value());
    if (refused) throw EveryRankError(*refused);
  }

  // Where another rank refused its inputs to `call` (Run::first_refusing_rank), EveryRankError
  // naming it; otherwise returns, for this rank to go on or raise its own error.
  void agree_on_refusal(const std::string& call, bool refused_here) {
    const std::optional<int> first = run_->first_refusing_rank(refused_here);
    if (!refused_here && first) {
      throw EveryRankError(call + ": rank " + std::to_string(*first) + "'s inputs were refused (its error says "
                           "why); every rank raises, and the run goes on");
    }
  }

  // What step() divides the gradients summed over the ranks by.
  double grad_divisor() { return reduction_ == GradReduction::mean ? static_cast<double>(run_->comm().size()) : 1.0; }

  RunConfig config_;
  GradReduction reduction_;
  LrSchedule schedule_;
  std::unique_ptr<Run> run_;
  int64_t steps_ = 0;  // optimizer steps applied, resumed ones included
  int64_t skipped_steps_ = 0;  // updates skipped for a gradient norm that was not finite
  std::optional<std::string> out_of_step_;  // why this rank left the others' collectives, once it has
};

}  // namespace

}  // namespace fsdpp

namespace {
PyObject* error_type = nullptr;  // fsdpp.Error
}  // namespace

PYBIND11_MODULE(_fsdpp, m) {
  using fsdpp::PythonRun;
  // The binary's CPU-kernel cap, set at import, before the loop runs a kernel: where the CPU
  // advertises AMX without enabling it, a bf16 product would end the interpreter.
  fsdpp::cap_cpu_kernels();
  m.doc() = "fsdpp's Run, driven from Python (see the fsdpp package)";
  error_type = py::register_exception<fsdpp::UserError>(m, "Error").ptr();
  // A collective another rank left, and a path the system refuses (too long, a loop of links),
  // wherever they arise, constructor included.
  py::register_exception_translator([](std::exception_ptr thrown) {
    try {
      if (thrown) std::rethrow_exception(thrown);
    } catch (const fsdpp::CollectiveFailure& e) {
      PyErr_SetString(error_type, fsdpp::message_line(e.what()).c_str());
    } catch (const std::filesystem::filesystem_error& e) {
      PyErr_SetString(error_type, fsdpp::message_line(e.what()).c_str());
    }
  });
  py::class_<PythonRun>(m, "Run")
      .def(py::init<const std::string&, const std::vector<std::string>&, const std::string&>(), py::arg("path"),
           py::arg("overrides"), py::arg("grad_reduction"))
      .def("forward", &PythonRun::forward, py::arg("input_ids"), py::arg("position_ids") = py::none(),
           py::arg("document_offsets") = py::none())
      .def("logprobs", &PythonRun::logprobs, py::arg("input_ids"), py::arg("targets"), py::arg("temperature") = 1.0,
           py::arg("position_ids") = py::none(), py::arg("document_offsets") = py::none())
      .def("refuse_inputs", &PythonRun::refuse_inputs, py::arg("call"))
      .def("step", &PythonRun::step)
      .def("full_weights", &PythonRun::full_weights, py::arg("unit"), py::arg("dtype"))
      .def("save", &PythonRun::save, py::arg("root") = py::none())
      .def("load", &PythonRun::load, py::arg("path"))
      .def("offload", &PythonRun::offload, py::arg("what"))
      .def("reload", &PythonRun::reload)
      .def("zero_grad", &PythonRun::zero_grad)
      .def("set_training", &PythonRun::set_training, py::arg("training"))
      .def_property_readonly("training", &PythonRun::training)
      .def_property_readonly("units", &PythonRun::units)
      .def_property_readonly("rank", &PythonRun::rank)
      .def_property_readonly("world_size", &PythonRun::world_size)
      .def_property_readonly("steps", &PythonRun::steps)
      .def_property_readonly("loss_scale", &PythonRun::loss_scale)
      .def_property_readonly("device", &PythonRun::device)
      .def_property_readonly("vocab_size", &PythonRun::vocab_size);
  py::class_<fsdpp::OpCounter>(m, "OpCounter")
      .def(py::init<>())
      .def("stop", [](fsdpp::OpCounter& counter) { return counter.stop().json(); });
}
