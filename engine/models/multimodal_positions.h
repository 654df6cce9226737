// Where Qwen2-VL and Qwen2.5-VL place their tokens: the multimodal RoPE positions of rows that
// hold images and videos as runs of placeholder tokens, planned on the host from the tokens
// and the grids. Also the check that the rows and the grids agree, before anything reaches a
// device or a collective: a caller's rows (the Python API) are checked by computing them.
#pragma once

#include "models/causal_lm.h"
#include "models/model_config.h"

namespace fsdpp {

// Positions [3, B, T] int64 on the host of input_ids [B, T]: text tokens count up on all three
// axes; a vision block's tokens take (frame, row, column) offsets from where the text stopped
// (Qwen2.5-VL spaces a video's frames by seconds × tokens_per_second), and the text after it
// resumes past the block's rows and columns. Each of `documents` (RowLayout::offsets;
// undefined: one per row) counts from 0 as if alone. The i-th run of image placeholders is
// image i of `vision`'s grids (videos alike). UserError where a run's length is not its grid's
// merged patch count, a run crosses a document's start, or the runs and grids differ in number.
at::Tensor multimodal_positions(const ModelConfig& config, const at::Tensor& input_ids, const VisionInputs& vision,
                                const at::Tensor& documents);

}  // namespace fsdpp
