// What a generation keeps between its steps: each attention layer's keys and values so far
// (after RoPE), and for every cached token its row's RoPE position and whether it is a token
// or padding. A step's queries attend over all of it, so a new token costs one token's
// forward instead of the whole sequence's.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>
#include <vector>

namespace fsdpp {

// One attention layer's keys and values: [B, heads, room, D] each, the first `length`
// positions filled; the room doubles as the generation needs it, up to the cache's capacity.
struct LayerCache {
  at::Tensor key, value;
  int64_t length = 0;

  // key/value [B, heads, T, D] of a step appended: everything cached, [B, heads, length + T, D].
  std::pair<at::Tensor, at::Tensor> append(const at::Tensor& key_step, const at::Tensor& value_step, int64_t capacity);
};

// The layout of one step of T tokens over the cache.
struct CachedStep {
  at::Tensor positions;  // [B, T] int64: each token's RoPE position, counting a row's tokens alone
  // The prompt's step: undefined, for the caller to build attention_scope
  // (models/document_attention.h) over `documents`, the rows' padding apart from their tokens
  // (undefined: none), as a training forward does. Later steps: [B, 1, T, cached + T] bool,
  // true where a query attends to a key.
  at::Tensor scope;
  at::Tensor documents;
};

// The documents (RowLayout::offsets) of rows padded on the left where `kept` [B, T] bool is
// false: each row's padding, then its tokens, so that the tokens are placed from 0.
at::Tensor left_padded_documents(const at::Tensor& kept);

class KvCache {
 public:
  // For `layers` attention layers and at most `capacity` tokens a row, prompt included;
  // `window` > 0: a query sees the last `window` positions alone (Mistral).
  KvCache(int64_t layers, int64_t capacity, int64_t window);

  // Lays out the next step's tokens, `kept` [B, T] bool (false: padding, which no query
  // sees; a left-padded prompt's first step). Call once per step, before its forward.
  CachedStep begin_step(const at::Tensor& kept);
  // Tokens cached before this step.
  int64_t cached() const { return length_; }
  // Moves the positions of every later step's tokens by `by` [B] int64: a vision-language
  // model's text after images sits past the images' rows and columns, not their token count.
  void shift_later_positions(const at::Tensor& by) { shift_ = by.view({-1, 1}); }
  LayerCache& layer(size_t index) { return layers_.at(index); }
  int64_t capacity() const { return capacity_; }

 private:
  std::vector<LayerCache> layers_;
  int64_t capacity_, window_;
  int64_t length_ = 0;    // tokens cached
  at::Tensor kept_;       // [B, room] bool, the first length_ filled; room doubles up to the capacity
  at::Tensor positions_;  // [B, room] int64, counting tokens alone; the first length_ filled
  at::Tensor shift_;      // [B, 1] added to the positions begin_step gives; undefined: none
};

}  // namespace fsdpp
