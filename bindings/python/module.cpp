// The Python extension _fsdpp: a Run driven from Python, one rank per process, for loops
// that bring their own rows and loss (RL: log-probabilities, ratios, KL). It is the run the
// binary builds, from the same run file and policies; fsdpp/__init__.py is its Python face.
// Every UserError becomes fsdpp.Error, one line naming the file, key or rank.
#include "bindings/lua/policy.h"
#include "core/cpu_kernels.h"
#include "core/dtype.h"
#include "core/error.h"
#include "distributed/comm.h"
#include "io/sharded_checkpoint.h"
#include "metrics/op_count.h"
#include "optim/lr_schedule.h"
#include "run/run.h"

#include <ATen/Parallel.h>
#include <torch/python.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <optional>
#include <sstream>
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

std::string shape_text(const at::Tensor& t) {
  std::string text = "[";
  for (int64_t d = 0; d < t.dim(); ++d) text += (d ? ", " : "") + std::to_string(t.size(d));
  return text + "]";
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
    check_token_ids("input_ids", input_ids);
    const RowLayout layout = checked_layout(input_ids, position_ids, document_offsets);
    return exclusively([&] {
      const NoAutocast own_precision;
      return run_->forward(input_ids, layout, grad_divisor());
    });
  }

  // Per-token log-probabilities [B, T] of targets [B, T] (the token each position predicts)
  // at `temperature`, chunked: no [B, T, V] logits are held (Run::logprobs).
  at::Tensor logprobs(const at::Tensor& input_ids, const at::Tensor& targets, double temperature,
                      const std::optional<at::Tensor>& position_ids, const std::optional<at::Tensor>& document_offsets) {
    check_token_ids("input_ids", input_ids);
    check_token_ids("targets", targets);
    if (targets.sizes() != input_ids.sizes()) {
      throw UserError("targets: expected the shape of input_ids " + shape_text(input_ids) + ", got " + shape_text(targets));
    }
    // Past these the logits / temperature overflow or flatten, and the log-probabilities are NaN or 0.
    if (!(temperature >= 1e-6 && temperature <= 1e6)) {
      std::ostringstream given;
      given << temperature;
      throw UserError("temperature: must be a positive number in [1e-06, 1e+06], got " + given.str());
    }
    const RowLayout layout = checked_layout(input_ids, position_ids, document_offsets);
    return exclusively([&] {
      const NoAutocast own_precision;
      return run_->logprobs(input_ids, targets, temperature, layout, grad_divisor());
    });
  }

  // One optimizer step from the gradients the backward calls since zero_grad left:
  // (global gradient norm before clipping, whether the update was applied).
  py::tuple step() {
    const UpdateFigures figures = exclusively([&] {
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
    if (root && root->empty()) throw UserError("save: the directory is an empty path");
    const std::filesystem::path dir = root ? *root : config_.checkpoint.dir;
    // The binary leaves a step saved twice as it is; here a load() may have rewound the step
    // count under a directory that holds the older checkpoint of that step.
    if (std::filesystem::exists(checkpoint_path(dir, steps_))) {
      throw UserError("save: " + checkpoint_path(dir, steps_).string() + " exists already; save to another "
                      "directory or remove it");
    }
    exclusively([&] { run_->save(steps_, ClientState{.skipped_steps = skipped_steps_}, dir); });
    return py::bytes(checkpoint_path(dir, steps_).string());
  }

  // Replaces the parameters, the optimizer's state and the step count with the checkpoint's.
  void load(const std::string& path) {
    exclusively([&] {
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
  int64_t units() const { return static_cast<int64_t>(run_->units()); }
  int rank() { return run_->comm().rank(); }
  int world_size() { return run_->comm().size(); }
  int64_t steps() const { return steps_; }
  std::optional<double> loss_scale() const { return run_->loss_scale(); }
  std::string device() const { return run_->device().str(); }
  int64_t vocab_size() const { return run_->model().config().vocab_size; }

 private:
  // `work` on the run with the GIL released, so that the loop's other Python threads go on
  // meanwhile, and one call at a time: a second thread's call, or a backward another thread
  // begins, waits for the first to end, and a call waits for a backward another thread runs
  // (Run::begin_call). One that ended in an exception is put right (FsdpState::settle_backward).
  template <typename Work>
  std::invoke_result_t<Work&> exclusively(Work&& work) {
    py::gil_scoped_release released;
    const auto call = run_->begin_call();
    run_->settle_backward();
    return work();
  }

  // What step() divides the gradients summed over the ranks by.
  double grad_divisor() { return reduction_ == GradReduction::mean ? static_cast<double>(run_->comm().size()) : 1.0; }

  // [batch, tokens] int64 ids of the model's vocabulary.
  void check_token_ids(const std::string& what, const at::Tensor& ids) const {
    if (ids.dim() != 2 || ids.scalar_type() != at::kLong) {
      throw UserError(what + ": expected a [batch, tokens] int64 tensor, got " +
                      std::string(c10::toString(ids.scalar_type())) + " " + shape_text(ids));
    }
    if (ids.numel() == 0) throw UserError(what + ": empty " + shape_text(ids));
    const int64_t vocab = vocab_size();
    const at::Tensor range = at::stack({ids.min(), ids.max()}).cpu();  // one wait for the device
    const int64_t low = range[0].item<int64_t>(), high = range[1].item<int64_t>();
    if (low < 0 || high >= vocab) {
      throw UserError(what + ": token ids must be in [0, " + std::to_string(vocab) + "), got " +
                      std::to_string(low < 0 ? low : high));
    }
  }

  static RowLayout checked_layout(const at::Tensor& ids, const std::optional<at::Tensor>& position_ids,
                                  const std::optional<at::Tensor>& document_offsets) {
    RowLayout layout;
    if (document_offsets) layout.offsets = checked_offsets(*document_offsets, ids);
    if (position_ids) {
      const at::Tensor& positions = *position_ids;
      if (positions.sizes() != ids.sizes() || positions.scalar_type() != at::kLong) {
        throw UserError("position_ids: expected an int64 tensor shaped as input_ids " + shape_text(ids) + ", got " +
                        std::string(c10::toString(positions.scalar_type())) + " " + shape_text(positions));
      }
      const int64_t lowest = positions.min().item<int64_t>();
      if (lowest < 0) throw UserError("position_ids: positions must be >= 0, got " + std::to_string(lowest));
      layout.positions = positions;
    }
    return layout;
  }

  static at::Tensor checked_offsets(const at::Tensor& offsets, const at::Tensor& ids) {
    const at::Tensor host = offsets.to(at::kCPU);
    if (host.dim() != 1 || host.scalar_type() != at::kLong || host.numel() < 2) {
      throw UserError("document_offsets: expected a [documents + 1] int64 tensor, got " +
                      std::string(c10::toString(host.scalar_type())) + " " + shape_text(host));
    }
    const bool rising = (host.slice(0, 1) > host.slice(0, 0, -1)).all().item<bool>();
    if (host[0].item<int64_t>() != 0 || host[-1].item<int64_t>() != ids.numel() || !rising) {
      throw UserError("document_offsets: must rise from 0 to the " + std::to_string(ids.numel()) +
                      " tokens of input_ids " + shape_text(ids));
    }
    // Attention stays within a row: a document ends at each row's end.
    const at::Tensor contiguous = host.contiguous();
    const int64_t* begin = contiguous.data_ptr<int64_t>();
    const int64_t* end = begin + contiguous.numel();
    const int64_t tokens = ids.size(1);
    for (int64_t row = 1; row < ids.size(0); ++row) {
      if (!std::binary_search(begin, end, row * tokens)) {
        throw UserError("document_offsets: a document spans rows " + std::to_string(row - 1) + " and " +
                        std::to_string(row) + ": no offset is " + std::to_string(row * tokens) + ", where row " +
                        std::to_string(row) + " of " + std::to_string(tokens) + " tokens starts");
      }
    }
    return host;
  }

  RunConfig config_;
  GradReduction reduction_;
  LrSchedule schedule_;
  std::unique_ptr<Run> run_;
  int64_t steps_ = 0;  // optimizer steps applied, resumed ones included
  int64_t skipped_steps_ = 0;  // updates skipped for a gradient norm that was not finite
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
      .def("step", &PythonRun::step)
      .def("full_weights", &PythonRun::full_weights, py::arg("unit"), py::arg("dtype"))
      .def("save", &PythonRun::save, py::arg("root") = py::none())
      .def("load", &PythonRun::load, py::arg("path"))
      .def("offload", &PythonRun::offload, py::arg("what"))
      .def("reload", &PythonRun::reload)
      .def("zero_grad", &PythonRun::zero_grad)
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
