// The kernel count: what a backend runs is counted once, at the operator it receives; views,
// allocations and the parts of composed operators are not; bytes are each distinct tensor an
// operator reads or writes, at its size, or at the rows an index names of a table.
#include "core/error.h"
#include "metrics/op_count.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

using namespace fsdpp;

namespace {

int64_t calls_of(const OpCounts& c, const std::string& op) {
  const auto it = c.by_op.find(op);
  return it == c.by_op.end() ? 0 : it->second.calls;
}

}  // namespace

TEST_CASE("op count: a composed operator counts as the kernels it runs, views as none", "[metrics]") {
  const auto x = torch::randn({64, 256});  // [N, C], 64 KiB
  const auto w = torch::randn({32, 256});
  OpCounter counter;
  const auto y = at::linear(x, w);          // t (a view) and mm
  const auto half = x.to(at::kBFloat16);    // _to_copy, not its copy_ inside
  const auto moved = x.t().contiguous();    // a view, then one clone
  const auto mean = x.pow(2).mean(-1);      // pow, then mean (not the fill_ it starts from)
  const auto flat = x.view({-1}).narrow(0, 0, 16);  // views only
  const OpCounts c = counter.stop();

  CHECK(c.kernels == 5);
  CHECK(c.matmul_kernels == 1);
  CHECK(calls_of(c, "aten::mm") == 1);
  CHECK(calls_of(c, "aten::_to_copy") == 1);
  CHECK(calls_of(c, "aten::copy_") == 0);
  CHECK(calls_of(c, "aten::clone") == 1);
  CHECK(calls_of(c, "aten::mean") == 1);
  CHECK(calls_of(c, "aten::fill_") == 0);
  CHECK(calls_of(c, "aten::linear") == 0);
  CHECK(calls_of(c, "aten::view") == 0);
  const int64_t x_bytes = 64 * 256 * 4;
  // _to_copy reads x and writes half its size; clone and pow read and write x's size; mean
  // reads pow's result and writes 64 floats. mm's bytes are the product's, not the rest's.
  CHECK(c.by_op.at("aten::_to_copy").bytes == x_bytes + x_bytes / 2);
  CHECK(c.by_op.at("aten::clone").bytes == 2 * x_bytes);
  CHECK(c.other_bytes == (x_bytes + x_bytes / 2) + 2 * x_bytes + 2 * x_bytes + (x_bytes + 64 * 4));
}

TEST_CASE("op count: an in-place operator's tensor counts read and written; backward's kernels count too",
          "[metrics]") {
  auto a = torch::randn({1000});
  const auto b = torch::randn({1000});
  auto w = torch::randn({1000}, torch::requires_grad());
  OpCounter counter;
  a.add_(b);  // reads a and b, writes a
  (w * b).sum().backward();
  const OpCounts c = counter.stop();
  CHECK(c.by_op.at("aten::add_").calls == 1);
  CHECK(c.by_op.at("aten::add_").bytes == 3 * 1000 * 4);
  // Forward mul and sum; backward the loss's seed gradient (ones_like), the sum's gradient
  // expanded (a view) and multiplied by b, which becomes w.grad as it is (a first gradient).
  CHECK(calls_of(c, "aten::mul") == 2);
  CHECK(calls_of(c, "aten::sum") == 1);
  CHECK(calls_of(c, "aten::ones_like") == 1);
  CHECK(c.kernels == 5);
}

TEST_CASE("op count: an operator with a kernel of its own counts though it also has a composition", "[metrics]") {
  // silu_backward runs its own CPU and GPU kernels; its composition serves other backends.
  auto x = torch::randn({1000}, torch::requires_grad());
  OpCounter counter;
  torch::silu(x).sum().backward();
  const OpCounts c = counter.stop();
  CHECK(calls_of(c, "aten::silu_backward") == 1);
  CHECK(calls_of(c, "aten::sigmoid") == 0);
  CHECK(c.by_op.at("aten::silu_backward").bytes == 3 * 1000 * 4);  // the gradient and x read, one written
}

TEST_CASE("op count: fused AdamW reads four tensors and writes three; an out= result is written alone", "[metrics]") {
  std::vector<at::Tensor> params{torch::randn({1000})}, grads{torch::randn({1000})};
  std::vector<at::Tensor> moments{torch::zeros({1000})}, squares{torch::zeros({1000})}, steps{torch::ones({})};
  auto sum = torch::empty({1000});
  OpCounter counter;
  at::_fused_adamw_(params, grads, moments, squares, {}, steps, 1e-3, 0.9, 0.999, 0.01, 1e-8, false, false);
  at::add_out(sum, params[0], grads[0]);
  const OpCounts c = counter.stop();
  // The parameter, gradient and two moments read, the parameter and moments written (28 B a
  // float32 parameter); the step count read.
  CHECK(c.by_op.at("aten::_fused_adamw_").bytes == 7 * 1000 * 4 + 4);
  CHECK(c.by_op.at("aten::add").bytes == 3 * 1000 * 4);
}

TEST_CASE("op count: zeros_like writes its result and reads nothing of its input", "[metrics]") {
  const auto x = torch::randn({1000});
  OpCounter counter;
  const auto zeros = torch::zeros_like(x);
  const OpCounts c = counter.stop();
  CHECK(calls_of(c, "aten::zeros_like") == 1);
  CHECK(c.by_op.at("aten::zeros_like").bytes == 1000 * 4);
}

TEST_CASE("op count: a lookup or an indexed add is charged the table's rows its index names", "[metrics]") {
  const auto table = torch::randn({1000, 64});             // [V, C]
  const auto columns = torch::randn({64, 1000});           // [C, V]
  const auto index = torch::tensor({3, 7, 7, 999, 0});     // [n] int64, a row named twice
  const auto rows = torch::randn({5, 64});                 // [n, C]
  auto sums = torch::zeros({1000, 64});
  const auto small = torch::randn({2, 64});                // [2, C]: named more often than it has rows
  OpCounter counter;
  const auto looked_up = at::embedding(table, index);      // [n, C]
  const auto picked = columns.index_select(1, index);      // [C, n]
  sums.index_add_(0, index, rows);
  const auto repeated = small.index_select(0, torch::tensor({0, 1, 1, 0, 1}));
  const OpCounts c = counter.stop();
  const int64_t row = 64 * 4, index_bytes = 5 * 8;
  CHECK(c.by_op.at("aten::embedding").bytes == 5 * row + index_bytes + 5 * row);  // rows read, index, result
  // index_add_'s table is also its result: its rows read and written, the index, the added rows.
  CHECK(c.by_op.at("aten::index_add_").bytes == 5 * row + index_bytes + 5 * row + 5 * row);
  // Two index_selects: 5 columns of 64 and their result; then the whole 2-row table at most.
  CHECK(c.by_op.at("aten::index_select").bytes == (5 * row + index_bytes + 5 * row) + (2 * row + index_bytes + 5 * row));
}

TEST_CASE("op count: nll_loss reads each row's target alone, and its backward only its input's shape", "[metrics]") {
  const auto logp = torch::randn({8, 1000}, torch::requires_grad());  // [N, V]
  const auto target = torch::randint(1000, {8});                      // [N] int64
  OpCounter counter;
  torch::nll_loss(logp, target).backward();
  const OpCounts c = counter.stop();
  // Forward: a float per row, the targets, the loss and the total weight (two scalars).
  CHECK(c.by_op.at("aten::nll_loss_forward").bytes == 8 * 4 + 8 * 8 + 2 * 4);
  // Backward: the loss's gradient and the total weight, the targets, and the gradient written whole.
  CHECK(c.by_op.at("aten::nll_loss_backward").bytes == 2 * 4 + 8 * 8 + 8 * 1000 * 4);
}

TEST_CASE("op count: one count at a time, each from zero, written as JSON", "[metrics]") {
  const auto x = torch::randn({8});
  std::optional<OpCounter> first(std::in_place);
  CHECK_THROWS_AS(OpCounter(), UserError);
  const auto y = x + x;
  const OpCounts one = first->stop();
  first.reset();

  OpCounter second;
  const auto z = x * x;
  const auto u = x * x;
  const OpCounts two = second.stop();
  CHECK(one.kernels == 1);
  CHECK(calls_of(one, "aten::add") == 1);
  CHECK(two.kernels == 2);
  CHECK(calls_of(two, "aten::add") == 0);

  const auto json = nlohmann::json::parse(two.json());
  CHECK(json["kernels"] == 2);
  CHECK(json["other_kernels"] == 2);
  CHECK(json["other_bytes"] == 2 * (8 * 4 + 8 * 4));  // per call: x once (read twice), the product
  CHECK(json["ops"]["aten::mul"]["calls"] == 2);
}
