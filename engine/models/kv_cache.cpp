// The cache's bookkeeping: buffers filled in place, and each step's positions and mask.
#include "models/kv_cache.h"

#include "core/error.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

namespace fsdpp {

std::pair<at::Tensor, at::Tensor> LayerCache::append(const at::Tensor& key_step, const at::Tensor& value_step,
                                                     int64_t capacity) {
  const int64_t steps = key_step.size(2);
  TORCH_CHECK(length + steps <= capacity, "a generation ran past its cache's ", capacity, " tokens");
  // Room for twice what is held, within the capacity: rows that end early never hold the
  // longest generation's keys, and appending stays amortised O(1).
  if (!key.defined() || length + steps > key.size(2)) {
    const int64_t room = std::min(capacity, std::max(length + steps, 2 * length));
    const auto grown = [&](const at::Tensor& held, const at::Tensor& step) {
      at::Tensor buffer = at::empty({step.size(0), step.size(1), room, step.size(3)}, step.options());
      if (length > 0) buffer.narrow(2, 0, length).copy_(held.narrow(2, 0, length));
      return buffer;
    };
    key = grown(key, key_step);
    value = grown(value, value_step);
  }
  key.narrow(2, length, steps).copy_(key_step);
  value.narrow(2, length, steps).copy_(value_step);
  length += steps;
  return {key.narrow(2, 0, length), value.narrow(2, 0, length)};
}

KvCache::KvCache(int64_t layers, int64_t capacity, int64_t window)
    : layers_(static_cast<size_t>(layers)), capacity_(capacity), window_(window) {}

CachedStep KvCache::begin_step(const at::Tensor& kept) {
  const at::Tensor tokens = kept.to(at::kBool);  // [B, T]
  const int64_t B = tokens.size(0), T = tokens.size(1), cached = length_, length = length_ + T;
  TORCH_CHECK(length <= capacity_, "a generation ran past its cache's ", capacity_, " tokens");
  if (!kept_.defined() || length > kept_.size(1)) {
    // Room that doubles as the layers' caches do, up to the capacity: a capacity far past
    // where every row ends costs nothing.
    const int64_t room = std::min(capacity_, std::max(length, kept_.defined() ? 2 * kept_.size(1) : length));
    at::Tensor kept = at::empty({B, room}, tokens.options());
    at::Tensor positions = at::empty({B, room}, tokens.options().dtype(at::kLong));
    if (cached > 0) {
      kept.narrow(1, 0, cached).copy_(kept_.narrow(1, 0, cached));
      positions.narrow(1, 0, cached).copy_(positions_.narrow(1, 0, cached));
    }
    kept_ = kept;
    positions_ = positions;
  }
  // A token's position is the count of its row's tokens before it, as transformers places
  // them from the attention mask (padding's is never read).
  const at::Tensor before = cached > 0 ? positions_.narrow(1, cached - 1, 1) + kept_.narrow(1, cached - 1, 1)
                                       : at::zeros({B, 1}, positions_.options());
  const at::Tensor counted = tokens.to(at::kLong).cumsum(1);             // [B, T]
  const at::Tensor positions = before + counted - tokens.to(at::kLong);  // [B, T]
  kept_.narrow(1, cached, T).copy_(tokens);
  positions_.narrow(1, cached, T).copy_(positions);
  length_ = length;
  const at::Tensor shifted = shift_.defined() ? positions + shift_ : positions;
  if (cached == 0) {
    const bool padded = !tokens.all().item<bool>();
    return {shifted, at::Tensor(), padded ? left_padded_documents(tokens).to(tokens.device()) : at::Tensor()};
  }
  // Query i (the cache's position cached + i) sees key j <= cached + i that is a token, and
  // within the window; a padding query sees itself alone, so that no row of the mask is empty.
  const at::Tensor query_index = at::arange(cached, length, positions.options()).view({1, 1, T, 1});
  const at::Tensor key_index = at::arange(length, positions.options()).view({1, 1, 1, length});
  at::Tensor scope = (key_index <= query_index) & kept_.narrow(1, 0, length).view({B, 1, 1, length});
  if (window_ > 0) {
    scope &= positions_.narrow(1, 0, length).view({B, 1, 1, length}) > positions.view({B, 1, T, 1}) - window_;
  }
  scope |= key_index == query_index;
  return {shifted, scope, at::Tensor()};
}

at::Tensor left_padded_documents(const at::Tensor& kept) {
  const int64_t B = kept.size(0), T = kept.size(1);
  const at::Tensor padding = (~kept.to(at::kCPU, at::kBool)).sum(1);  // [B]
  std::vector<int64_t> offsets;
  for (int64_t b = 0; b < B; ++b) {
    offsets.push_back(b * T);
    const int64_t pad = padding[b].item<int64_t>();
    if (pad > 0 && pad < T) offsets.push_back(b * T + pad);
  }
  offsets.push_back(B * T);
  return at::tensor(offsets, at::kLong);
}

}  // namespace fsdpp
