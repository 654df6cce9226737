// Positions, masks and attention for packed documents and sliding windows: ATen's
// variable-length flash kernel where the device has it, else a block-diagonal, banded causal
// mask for ATen's fused attention.
#include "models/document_attention.h"

#include <ATen/ATen.h>

#include <map>
#include <mutex>

namespace fsdpp {

namespace {

// The document each token belongs to: [B * T] int64, from the offsets without a host sync
// (the output size is known, so repeat_interleave needs not read the lengths back).
at::Tensor document_of_token(const at::Tensor& documents, int64_t tokens) {
  const int64_t S = documents.size(0) - 1;
  auto lengths = documents.narrow(0, 1, S) - documents.narrow(0, 0, S);  // [S]
  return at::repeat_interleave(at::arange(S, documents.options()), lengths, 0, tokens);
}

// attention_scope's mask.
at::Tensor restricted_causal_mask(const at::Tensor& documents, int64_t window, int64_t batch, int64_t seq_len,
                                  const at::Device& device) {
  const int64_t T = seq_len;
  if (window >= T) window = 0;  // a window no shorter than the rows restricts nothing
  if (!documents.defined() && window == 0) return {};
  // Each token always sees itself, so no row of the mask is empty (an empty one would give
  // NaN through the softmax); padding attends to padding alone.
  auto mask = at::ones({T, T}, at::TensorOptions(at::kBool).device(device)).tril();  // [T, T]
  if (window > 0) mask = mask.triu(1 - window);  // key j of query i: i - window < j <= i
  mask = mask.unsqueeze(0);                       // [1, T, T]
  if (documents.defined()) {
    auto owner = document_of_token(documents.to(device), batch * T).view({batch, T});  // [B, T]
    mask = mask & (owner.unsqueeze(2) == owner.unsqueeze(1));                        // [B, T, T]
  }
  return mask.unsqueeze(1);  // [B, 1, T, T]
}

// The variable-length flash kernel's limits on a head (flash attention 2's).
constexpr int64_t kFlashMaxHeadDim = 256;
constexpr int64_t kFlashHeadDimMultiple = 8;

bool is_half(at::ScalarType dtype) { return dtype == at::kBFloat16 || dtype == at::kHalf; }

// Whether a GPU runs the flash kernel (compute capability 8.0 or newer), asked once per device
// by running it on a few zeros: c10 reports no compute capability without the CUDA headers.
bool runs_flash_kernel(const c10::Device& device) {
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, bool> known;  // by index: activations always carry one
  std::lock_guard lock(mutex);
  if (auto it = known.find(device.index()); it != known.end()) return it->second;
  bool runs = true;
  try {
    at::NoGradGuard no_grad;
    const int64_t tokens = 8, head_dim = 64;
    const auto zeros = at::zeros({tokens, 1, head_dim}, at::TensorOptions(at::kBFloat16).device(device));  // [tokens, heads, D]
    const auto offsets = at::tensor(std::vector<int32_t>{0, static_cast<int32_t>(tokens)}).to(device);
    at::_flash_attention_forward(zeros, zeros, zeros, offsets, offsets, tokens, tokens, 0.0, /*is_causal=*/true, false);
  } catch (const c10::Error&) {
    runs = false;
  }
  return known[device.index()] = runs;
}

// scoped_attention over document offsets: every document of every row one sequence of the
// kernel, tokens laid out [B * T, heads, D].
at::Tensor variable_length_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                     const at::Tensor& offsets, std::optional<double> scale) {
  const int64_t B = query.size(0), H = query.size(1), T = query.size(2), Dv = value.size(3);
  const auto tokens = [B, T](const at::Tensor& x) {  // [B, heads, T, D] -> [B * T, heads, D]
    return x.transpose(1, 2).reshape({B * T, x.size(1), x.size(3)});
  };
  // The kernel takes one head size for q, k and v: a narrower v is padded with zeros, which
  // add zero columns to the output.
  auto v = tokens(value);
  if (Dv < query.size(3)) v = at::constant_pad_nd(v, {0, query.size(3) - Dv});
  // No document is longer than a row, so T bounds every sequence the kernel sees.
  auto out = std::get<0>(at::_flash_attention_forward(tokens(query), tokens(key), v, offsets, offsets, T, T,
                                                      /*dropout_p=*/0.0, /*is_causal=*/true,
                                                      /*return_debug_mask=*/false, scale));  // [B * T, H, D]
  return out.narrow(-1, 0, Dv).reshape({B, T, H, Dv}).transpose(1, 2);                  // [B, H, T, Dv]
}

}  // namespace

at::Tensor document_positions(const at::Tensor& documents, int64_t batch, int64_t seq_len) {
  const int64_t tokens = batch * seq_len;
  auto owner = document_of_token(documents, tokens);  // [B * T]
  return (at::arange(tokens, documents.options()) - documents.index_select(0, owner)).view({batch, seq_len});
}

at::Tensor attention_scope(const at::Tensor& documents, int64_t window, int64_t batch, int64_t seq_len,
                           const at::TensorOptions& activations, int64_t head_dim) {
  const auto device = activations.device();
  const bool flash = device.is_cuda() && is_half(activations.dtype().toScalarType()) && head_dim <= kFlashMaxHeadDim &&
                     head_dim % kFlashHeadDimMultiple == 0;
  if (documents.defined() && flash && (window == 0 || window >= seq_len) && runs_flash_kernel(device)) {
    return documents.to(device, at::kInt);  // [S + 1]
  }
  return restricted_causal_mask(documents, window, batch, seq_len, device);
}

at::Tensor scoped_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& scope, std::optional<double> scale) {
  at::Tensor mask = scope;
  if (scope.defined() && scope.scalar_type() == at::kInt) {
    if (is_half(query.scalar_type())) return variable_length_attention(query, key, value, scope, scale);
    // A layer that computes in another dtype than the hidden states it is handed (a unit of
    // a precision of its own) takes the mask of the same documents.
    mask = restricted_causal_mask(scope.to(at::kLong), /*window=*/0, query.size(0), query.size(2), query.device());
  }
  // Each key/value head serves H / KV query heads inside the kernel: copies expanded to every
  // query head would be kept for backward too.
  return at::scaled_dot_product_attention(query, key, value, mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt,
                                          /*dropout_p=*/0.0, /*is_causal=*/!mask.defined(), scale,
                                          /*enable_gqa=*/key.size(1) != query.size(1));  // [B, H, T, Dv]
}

}  // namespace fsdpp
