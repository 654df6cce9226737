// A decoder layer's residual add followed by an RMSNorm of the sum: h = x + delta, then
// norm(h). On a GPU, where the norm runs alone (no hook, no unit of its own) in its input's
// dtype, both run as one CUDA kernel each way (models/norm_kernels.cu): forward reads x and
// delta once and writes h and the norm; backward adds the norm's gradient of h to what h
// receives from the rest of the layer in the same pass. Elsewhere an add and the norm's call.
#pragma once

#include "models/layers.h"

namespace fsdpp {

struct ResidualNorm {
  torch::Tensor sum;     // [..., C] x + delta
  torch::Tensor normed;  // [..., C] norm(sum)
};

ResidualNorm add_then_norm(const torch::Tensor& x, const torch::Tensor& delta, RMSNorm& norm);

}  // namespace fsdpp
