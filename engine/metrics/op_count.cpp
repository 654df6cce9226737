// The counter is a pair of global RecordFunction observers. Each thread keeps a stack of the
// operator calls it is inside. A call is a kernel when no kernel encloses it and it is an
// operator a backend implements (not one composed of others in its dispatcher entry, such as
// linear or to, whose parts are counted instead), and not a view, an allocation, a question
// about tensors or a collective. What a kernel calls inside itself (mean zero-filling its
// result, _to_copy's copy_) is part of it. This is the stream of operators a backend receives,
// as a dispatch mode in Python sees it.
#include "metrics/op_count.h"

#include "core/error.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <optional>
#include <string_view>
#include <vector>

namespace fsdpp {

namespace {

// What the observers add to while a counter runs.
struct Tally {
  std::mutex mutex;
  OpCounts counts;
};
std::atomic<Tally*> active_tally{nullptr};
// A new counter's number: a thread's stack left from an earlier counter (a call that
// entered before it stopped) is dropped rather than read.
std::atomic<uint64_t> counter_generation{0};

using TensorKey = std::pair<const void*, int64_t>;  // address and size

// An operator call this thread is inside. A kernel's arguments are readable only as it
// enters (the dispatcher frees their boxed copies after), so their sizes are taken then.
struct Call {
  bool kernel = false;
  std::vector<TensorKey> seen;  // the distinct tensors read or written so far
  int64_t bytes = 0;            // their sizes
};

struct CallStack {
  uint64_t generation = 0;
  std::vector<Call> calls;
  int64_t kernels_open = 0;  // calls on the stack that are kernels
};

CallStack& this_thread_stack() {
  thread_local CallStack stack;
  const uint64_t now = counter_generation.load(std::memory_order_relaxed);
  if (stack.generation != now) {
    stack.generation = now;
    stack.calls.clear();
    stack.kernels_open = 0;
  }
  return stack;
}

bool starts_with(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }

// Every result aliases an argument without writing it: a view, which launches nothing.
bool is_view(const c10::FunctionSchema& schema) {
  if (schema.returns().empty()) return false;
  return std::all_of(schema.returns().begin(), schema.returns().end(), [](const c10::Argument& r) {
    return r.alias_info() != nullptr && !r.alias_info()->isWrite();
  });
}

// Neither returns a tensor nor writes one: a question about tensors (result_type,
// is_same_size), unless it reads a value back (item).
bool is_metadata(std::string_view name, const c10::FunctionSchema& schema) {
  if (name == "aten::_local_scalar_dense" || name == "aten::equal" || name == "aten::is_nonzero") return false;
  const auto tensor = [](const c10::Argument& a) { return a.type()->str().find("Tensor") != std::string::npos; };
  const auto written = [](const c10::Argument& a) { return a.alias_info() != nullptr && a.alias_info()->isWrite(); };
  return std::none_of(schema.returns().begin(), schema.returns().end(), tensor) &&
         std::none_of(schema.arguments().begin(), schema.arguments().end(), written);
}

// Operators that only allocate or re-describe memory.
bool is_allocation(std::string_view name) {
  static constexpr std::array<std::string_view, 7> kNames = {
      "aten::resize_",       "aten::set_",        "aten::lift_fresh",  "aten::record_stream",
      "aten::_unsafe_view",  "aten::as_strided_", "aten::_reshape_alias"};
  return starts_with(name, "aten::empty") || starts_with(name, "aten::new_empty") ||
         std::find(kNames.begin(), kNames.end(), name) != kNames.end();
}

// Composed of other operators in its dispatcher entry (CompositeImplicitAutograd), whose
// operators are counted instead. An operator with a kernel of its own for the CPU or a GPU
// runs that one there (silu_backward has both: its composition serves other backends).
bool is_composite(const c10::FunctionSchema& schema) {
  const auto op = c10::Dispatcher::singleton().findSchema({schema.name(), schema.overload_name()});
  return op && op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) &&
         !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) && !op->hasKernelForDispatchKey(c10::DispatchKey::CUDA);
}

// A kernel, unless inside one: one of the engine's recorded kernels, or an operator a backend
// implements that is no view, allocation, question or collective.
bool is_kernel(const at::RecordFunction& fn) {
  const std::string_view name = fn.name();
  if (starts_with(name, "fsdpp::")) return true;
  const auto schema = fn.operator_schema();
  if (!schema || starts_with(name, "c10d::") || is_allocation(name)) return false;
  return !is_view(*schema) && !is_metadata(name, *schema) && !is_composite(*schema);
}

bool is_matmul(std::string_view name) {
  static constexpr std::array<std::string_view, 12> kNames = {
      "aten::mm",     "aten::addmm",       "aten::bmm",         "aten::baddbmm",
      "aten::addbmm", "aten::_scaled_mm",  "aten::_grouped_mm", "aten::_scaled_grouped_mm",
      "aten::mv",     "aten::addmv",       "aten::_int_mm",     "aten::_addmm_activation"};
  return std::find(kNames.begin(), kNames.end(), name) != kNames.end();
}

bool is_attention(std::string_view name) {
  for (std::string_view part : {"scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention"}) {
    if (name.find(part) != std::string_view::npos) return true;
  }
  return false;
}

// Adds `t`'s size to `call` unless the call has seen it, charging `charged` bytes of it when
// given (the rows an index touches), else all of them.
void add_tensor(const at::Tensor& t, Call& call, std::optional<int64_t> charged = std::nullopt) {
  if (!t.defined() || !t.has_storage()) return;
  const int64_t size = static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
  // The address from the storage itself: data_ptr() checks the tensor and may throw, which an
  // observer must not (a parameter between gathers has elements but no memory).
  const auto* first = static_cast<const char*>(t.storage().data()) + t.storage_offset() * t.element_size();
  const TensorKey key{first, size};
  if (std::find(call.seen.begin(), call.seen.end(), key) != call.seen.end()) return;
  call.seen.push_back(key);
  call.bytes += charged.value_or(size);
}

// Adds the sizes of the tensors in `values` that `call` has not seen yet.
void add_tensor_bytes(c10::ArrayRef<c10::IValue> values, Call& call) {
  for (const auto& v : values) {
    if (v.isTensor()) {
      add_tensor(v.toTensor(), call);
    } else if (v.isList()) {  // tensor lists and lists of optional tensors
      for (const c10::IValue& item : v.toListRef()) {
        if (item.isTensor()) add_tensor(item.toTensor(), call);
      }
    }
  }
}

// An argument an operator touches less of than its whole: the rows of a table an index names
// (an embedding's lookup, index_add_ adding rows into a gradient), one element per index in
// each row (nll_loss reading each row's target), or nothing but its shape (zeros_like, and
// nll_loss_backward's input, whose gradient it writes whole). Where the argument and its
// index are among the operator's inputs, and the one holding the indexed dimension (none: 0).
struct PartialArgument {
  enum class Touched { indexed_rows, one_per_index, shape_only };
  std::string_view op;
  Touched touched;
  size_t arg, index = 0;
  std::optional<size_t> dim;
};

const PartialArgument* partial_argument(std::string_view name) {
  using enum PartialArgument::Touched;
  // Not index_add or index_copy: out of place, they copy the whole table first.
  static constexpr std::array<PartialArgument, 6> kOps = {{{"aten::embedding", indexed_rows, 0, 1, std::nullopt},
                                                           {"aten::index_select", indexed_rows, 0, 2, 1},
                                                           {"aten::index_add_", indexed_rows, 0, 2, 1},
                                                           {"aten::index_copy_", indexed_rows, 0, 2, 1},
                                                           {"aten::nll_loss_forward", one_per_index, 0, 1},
                                                           {"aten::nll_loss_backward", shape_only, 1}}};
  static constexpr PartialArgument kLike{"*_like", shape_only, 0};
  if (name.ends_with("_like")) return &kLike;
  const auto it = std::find_if(kOps.begin(), kOps.end(), [&](const PartialArgument& op) { return op.op == name; });
  return it == kOps.end() ? nullptr : &*it;
}

// The bytes of `partial`'s argument that its operator touches; nullopt where the inputs are
// not as its schema has them, which charges the whole.
std::optional<int64_t> touched_bytes(const PartialArgument& partial, c10::ArrayRef<c10::IValue> inputs) {
  using enum PartialArgument::Touched;
  if (inputs.size() <= partial.arg || !inputs[partial.arg].isTensor()) return std::nullopt;
  const at::Tensor& t = inputs[partial.arg].toTensor();
  if (partial.touched == shape_only) return 0;
  if (inputs.size() <= partial.index || !inputs[partial.index].isTensor() || !t.defined() || t.numel() == 0) {
    return std::nullopt;
  }
  const int64_t named = inputs[partial.index].toTensor().numel();
  const int64_t element = static_cast<int64_t>(t.element_size());
  if (partial.touched == one_per_index) return std::min(named, t.numel()) * element;
  if (partial.dim && !inputs[*partial.dim].isInt()) return std::nullopt;
  int64_t dim = partial.dim ? inputs[*partial.dim].toInt() : 0;
  if (dim < 0) dim += t.dim();
  if (dim < 0 || dim >= t.dim()) return std::nullopt;  // the operator will refuse it; an observer must not throw
  return std::min(named, t.size(dim)) * (t.numel() / t.size(dim)) * element;  // a row named twice, twice
}

// Whether argument `i` of operator `name` is read and then written in place: one its schema
// marks written (Tensor(a!)), other than an out= argument, which is written alone. A fused
// Adam's gradients are marked so for the unscaling it may do, and are read alone without it.
bool read_and_written(std::string_view name, const c10::FunctionSchema& schema, size_t i) {
  const c10::Argument& argument = schema.arguments()[i];
  if (argument.alias_info() == nullptr || !argument.alias_info()->isWrite() || argument.kwarg_only()) return false;
  const bool fused_adam = name == "aten::_fused_adamw_" || name == "aten::_fused_adam_";
  return !(fused_adam && i == 1);
}

// An operator's inputs: the partial argument at what it touches, the rest whole; and once
// more what it writes in place, which it reads and then writes.
void add_input_bytes(const at::RecordFunction& fn, Call& call) {
  const std::string_view name = fn.name();
  const c10::ArrayRef<c10::IValue> inputs = fn.inputs();
  const PartialArgument* partial = partial_argument(name);
  std::optional<int64_t> touched;
  if (partial && (touched = touched_bytes(*partial, inputs))) add_tensor(inputs[partial->arg].toTensor(), call, touched);
  add_tensor_bytes(inputs, call);
  const auto schema = fn.operator_schema();
  if (!schema) return;
  for (size_t i = 0; i < std::min(inputs.size(), schema->arguments().size()); ++i) {
    if (!read_and_written(name, *schema, i)) continue;
    if (partial && partial->arg == i && touched) {
      call.bytes += *touched;
      continue;
    }
    Call written;  // its own tally: a tensor read before is written all the same
    add_tensor_bytes(inputs.slice(i, 1), written);
    call.bytes += written.bytes;
  }
}

void record_kernel(const at::RecordFunction& fn, Call& call, Tally& tally) {
  const std::string_view name = fn.name();
  add_tensor_bytes(fn.outputs(), call);
  const int64_t bytes = call.bytes;
  std::lock_guard lock(tally.mutex);
  OpCounts& c = tally.counts;
  ++c.kernels;
  if (is_matmul(name)) {
    ++c.matmul_kernels;
  } else if (is_attention(name)) {
    ++c.attention_kernels;
  } else {
    c.other_bytes += bytes;
  }
  OpTally& op = c.by_op[std::string(name)];
  ++op.calls;
  op.bytes += bytes;
}

// Some argument is a tensor subclass defined in Python (a DTensor): the call runs its
// __torch_dispatch__, whose operators on the local tensors are the kernels.
bool has_python_subclass(c10::ArrayRef<c10::IValue> values) {
  auto python = [](const c10::IValue& v) {
    return v.isTensor() && v.toTensor().defined() && v.toTensor().key_set().has(c10::DispatchKey::Python);
  };
  for (const auto& v : values) {
    if (python(v)) return true;
    if (v.isList()) {
      for (const c10::IValue& item : v.toListRef()) {
        if (python(item)) return true;
      }
    }
  }
  return false;
}

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  CallStack& stack = this_thread_stack();
  Call& call = stack.calls.emplace_back();
  call.kernel = stack.kernels_open == 0 && is_kernel(fn) && !has_python_subclass(fn.inputs());
  if (call.kernel) {
    ++stack.kernels_open;
    add_input_bytes(fn, call);
  }
  return nullptr;
}

void on_exit(const at::RecordFunction& fn, at::ObserverContext*) {
  CallStack& stack = this_thread_stack();
  if (stack.calls.empty()) return;  // entered before this counter began
  Call call = std::move(stack.calls.back());
  stack.calls.pop_back();
  if (!call.kernel) return;
  --stack.kernels_open;
  if (Tally* tally = active_tally.load(std::memory_order_acquire)) record_kernel(fn, call, *tally);
}

}  // namespace

std::string OpCounts::json() const {
  nlohmann::json ops = nlohmann::json::object();
  for (const auto& [name, tally] : by_op) ops[name] = {{"calls", tally.calls}, {"bytes", tally.bytes}};
  return nlohmann::json{{"kernels", kernels},
                        {"matmul_kernels", matmul_kernels},
                        {"attention_kernels", attention_kernels},
                        {"other_kernels", other_kernels()},
                        {"other_bytes", other_bytes},
                        {"ops", ops}}
      .dump();
}

OpCounter::OpCounter() {
  Tally* expected = nullptr;
  auto* tally = new Tally;
  if (!active_tally.compare_exchange_strong(expected, tally)) {
    delete tally;
    throw UserError("operator counting: another count is running in this process");
  }
  counter_generation.fetch_add(1);
  handle_ = at::addGlobalCallback(at::RecordFunctionCallback(on_enter, on_exit)
                                      .needsInputs(true)
                                      .needsOutputs(true)
                                      .scopes({at::RecordScope::FUNCTION}));
}

OpCounter::~OpCounter() {
  if (handle_ != 0) stop();
}

OpCounts OpCounter::stop() {
  TORCH_CHECK(handle_ != 0, "operator counting: stopped twice");
  at::removeCallback(handle_);
  handle_ = 0;
  std::unique_ptr<Tally> tally(active_tally.exchange(nullptr));
  return std::move(tally->counts);
}

}  // namespace fsdpp
