// The Python extension _fsdpp: PythonRun (python_run.h) as _fsdpp.Run, and the op counter.
// The package fsdpp (fsdpp/*.py) is its Python face. Every UserError becomes fsdpp.Error, one line naming
// the file, key or rank.
#include "bindings/python/python_run.h"
#include "core/cpu_kernels.h"
#include "core/error.h"
#include "metrics/op_count.h"

#include <torch/python.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;

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
      .def(py::init<const std::string&, const std::vector<std::string>&, const std::string&, bool>(), py::arg("path"),
           py::arg("overrides"), py::arg("grad_reduction"), py::arg("frozen"))
      .def("forward", &PythonRun::forward, py::arg("input_ids"), py::arg("position_ids"), py::arg("document_offsets"),
           py::arg("vision"))
      .def("hidden_states", &PythonRun::hidden_states, py::arg("input_ids"), py::arg("position_ids"),
           py::arg("document_offsets"), py::arg("vision"))
      .def("logprobs", &PythonRun::logprobs, py::arg("input_ids"), py::arg("targets"), py::arg("temperature"),
           py::arg("position_ids"), py::arg("document_offsets"), py::arg("vision"), py::arg("entropy"))
      .def(
          "generate",
          [](PythonRun& run, const at::Tensor& input_ids, const std::optional<at::Tensor>& attention_mask,
             int64_t max_new_tokens, double temperature, int64_t top_k, double top_p, const std::vector<int64_t>& eos,
             int64_t pad, const fsdpp::VisionArguments& vision, const fsdpp::OptionNames& names) {
            return run.generate(input_ids, attention_mask, vision,
                                fsdpp::GenerationOptions{max_new_tokens, temperature, top_k, top_p, eos, pad}, names);
          },
          py::arg("input_ids"), py::arg("attention_mask"), py::arg("max_new_tokens"), py::arg("temperature"),
          py::arg("top_k"), py::arg("top_p"), py::arg("eos"), py::arg("pad"), py::arg("vision"), py::arg("names"))
      .def("refuse_inputs", &PythonRun::refuse_inputs, py::arg("call"))
      .def("step", &PythonRun::step, py::arg("lr") = py::none())
      .def_property_readonly("scheduled_lr", &PythonRun::scheduled_lr)
      .def("full_weights", &PythonRun::full_weights, py::arg("unit"), py::arg("dtype"))
      .def("load_weights", &PythonRun::load_weights, py::arg("weights"))
      .def(
          "save",
          [](PythonRun& run, const std::optional<std::string>& root, const std::string& loop_state) {
            return py::bytes(run.save(root, loop_state));
          },
          py::arg("root"), py::arg("loop_state"))
      .def("load", &PythonRun::load, py::arg("path"))
      .def("offload", &PythonRun::offload, py::arg("what"))
      .def("reload", &PythonRun::reload)
      .def("zero_grad", &PythonRun::zero_grad)
      .def("set_training", &PythonRun::set_training, py::arg("training"))
      .def_property_readonly("training", &PythonRun::training)
      .def_property_readonly("frozen", &PythonRun::frozen)
      .def_property_readonly("loop_state", &PythonRun::loop_state)
      .def_property_readonly("units", &PythonRun::units)
      .def_property_readonly("rank", &PythonRun::rank)
      .def_property_readonly("world_size", &PythonRun::world_size)
      .def_property_readonly("steps", &PythonRun::steps)
      .def_property_readonly("weights_version", &PythonRun::weights_version)
      .def_property_readonly("loss_scale", &PythonRun::loss_scale)
      .def_property_readonly("device", &PythonRun::device)
      .def_property_readonly("vocab_size", &PythonRun::vocab_size)
      .def_property_readonly("hidden_size", &PythonRun::hidden_size)
      .def_property_readonly("model_dir", [](const PythonRun& run) { return py::bytes(run.model_dir()); });
  py::class_<fsdpp::OpCounter>(m, "OpCounter")
      .def(py::init<>())
      .def("stop", [](fsdpp::OpCounter& counter) { return counter.stop().json(); });
}
