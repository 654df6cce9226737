// One micro-batch as the model takes it: rows of token ids, their targets, and what else the
// rows carry (the documents packed into them, or images and videos).
#pragma once

#include "models/causal_lm.h"

namespace fsdpp {

struct MicroBatch {
  at::Tensor input;          // [rows, T] int64
  at::Tensor target;         // [rows, T] int64, kIgnoredTarget where nothing is predicted
  RowLayout layout;          // where packed documents begin (undefined offsets: one per row)
  VisionInputs vision;       // the rows' images and videos, in row order (none for text)

  // The batch's logits [rows, T, V] from `model` (the batch already on its device).
  at::Tensor logits(CausalLM& model) const {
    if (!vision.empty()) return model(input, vision, layout);
    if (!layout.empty()) return model(input, layout);
    return model(input);
  }
};

}  // namespace fsdpp
