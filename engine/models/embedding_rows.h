// An embedding lookup whose backward adds into the weight's .grad in place. ATen's own
// backward writes a [V, C] tensor of zeros with the batch's rows scattered in, and where the
// weight is tied to lm_head autograd then adds that whole tensor to lm_head's [V, C]
// gradient: two passes over the vocabulary for a few thousand rows. Here backward sums the
// rows of each distinct token (in float32 for bf16 and fp16, in a fixed order) and adds each
// sum once into the .grad that lm_head's gradient already fills, so the result is the same
// on every run of one device; how many distinct tokens there are is never read back to the
// host, so a GPU's backward does not wait here. The lookup does not pass its gradient through autograd's edge
// to the weight: backward() fills .grad, but autograd::grad() asked for the weight would not
// see the embedding's share.
#pragma once

#include <ATen/core/Tensor.h>

namespace fsdpp {

// weight [V, C], ids [...] -> [..., C]: weight's rows. Backward adds into weight.grad
// (allocating it where it is undefined) for every row but `padding_row` (>= 0; -1: none),
// which the lookup leaves without a gradient, as nn.Embedding's padding_idx does; a weight that
// needs no gradient, or a lookup with gradients disabled, is ATen's embedding.
at::Tensor embedding_rows(const at::Tensor& weight, const at::Tensor& ids, int64_t padding_row = -1);

}  // namespace fsdpp
