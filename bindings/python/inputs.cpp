#include "bindings/python/inputs.h"

#include "core/error.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <sstream>

namespace fsdpp {

namespace {

std::string type_and_shape(const at::Tensor& t) {
  return std::string(c10::toString(t.scalar_type())) + " " + shape_text(t);
}

at::Tensor checked_offsets(const at::Tensor& offsets, const at::Tensor& ids) {
  const at::Tensor host = offsets.to(at::kCPU);
  if (host.dim() != 1 || host.scalar_type() != at::kLong || host.numel() < 2) {
    throw UserError("document_offsets: expected a [documents + 1] int64 tensor, got " + type_and_shape(host));
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

}  // namespace

std::string shape_text(const at::Tensor& t) {
  std::string text = "[";
  for (int64_t d = 0; d < t.dim(); ++d) text += (d ? ", " : "") + std::to_string(t.size(d));
  return text + "]";
}

void check_token_ids(const std::string& what, const at::Tensor& ids, int64_t vocab) {
  if (ids.dim() != 2 || ids.scalar_type() != at::kLong) {
    throw UserError(what + ": expected a [batch, tokens] int64 tensor, got " + type_and_shape(ids));
  }
  if (ids.numel() == 0) throw UserError(what + ": empty " + shape_text(ids));
  const at::Tensor range = at::stack({ids.min(), ids.max()}).cpu();  // one wait for the device
  const int64_t low = range[0].item<int64_t>(), high = range[1].item<int64_t>();
  if (low < 0 || high >= vocab) {
    throw UserError(what + ": token ids must be in [0, " + std::to_string(vocab) + "), got " +
                    std::to_string(low < 0 ? low : high));
  }
}

void check_logprobs_inputs(const at::Tensor& input_ids, const at::Tensor& targets, double temperature, int64_t vocab) {
  check_token_ids("input_ids", input_ids, vocab);
  check_token_ids("targets", targets, vocab);
  if (targets.sizes() != input_ids.sizes()) {
    throw UserError("targets: expected the shape of input_ids " + shape_text(input_ids) + ", got " + shape_text(targets));
  }
  // Past these the logits / temperature overflow or flatten, and the log-probabilities are NaN or 0.
  if (!(temperature >= 1e-6 && temperature <= 1e6)) {
    std::ostringstream given;
    given << temperature;
    throw UserError("temperature: must be a positive number in [1e-06, 1e+06], got " + given.str());
  }
}

RowLayout checked_layout(const at::Tensor& ids, const std::optional<at::Tensor>& position_ids,
                         const std::optional<at::Tensor>& document_offsets) {
  RowLayout layout;
  if (document_offsets) layout.offsets = checked_offsets(*document_offsets, ids);
  if (position_ids) {
    const at::Tensor& positions = *position_ids;
    if (positions.sizes() != ids.sizes() || positions.scalar_type() != at::kLong) {
      throw UserError("position_ids: expected an int64 tensor shaped as input_ids " + shape_text(ids) + ", got " +
                      type_and_shape(positions));
    }
    const int64_t lowest = positions.min().item<int64_t>();
    if (lowest < 0) throw UserError("position_ids: positions must be >= 0, got " + std::to_string(lowest));
    layout.positions = positions;
  }
  return layout;
}

}  // namespace fsdpp
