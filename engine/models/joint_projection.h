// Several projections of one input as one matrix product, where their weights lie end to end
// in memory: attention's q_proj, k_proj and v_proj, or an MLP's gate_proj and up_proj, in a
// unit's gathered buffer, where no padding of a shard separates them (always in a shard group
// of one, as on a single GPU), or wherever an allocator happened to place them so. One product
// instead of three runs the small key and value products at the width of the query's, and
// backward gets the input's gradient from one product where it would sum several; the numbers
// differ from separate products by rounding alone. Anywhere else (weights apart, adapters,
// biases, hooks on a projection) each module computes alone.
#pragma once

#include "models/layers.h"

#include <vector>

namespace fsdpp {

// x [..., in] through every projection in `linears` as one product: [..., Σ out], each
// projection's outputs in turn. Undefined when the projections cannot share one product: the
// caller then calls each module.
torch::Tensor joint_projection(const std::vector<const Linear*>& linears, const torch::Tensor& x);

}  // namespace fsdpp
