// CUDA kernels for the next-token loss over logits that ATen would first widen to float32:
// each row's log-sum-exp and loss from one read of the logits, and their gradient from one
// read and one write, in float32 math rounded once to the logits' type. Plain pointers, as in
// models/fused_kernels.h; launches go on the current stream of `device`.
#pragma once

#include "models/fused_kernels.h"

#include <cstdint>

namespace fsdpp::kernels {

// Logits [rows, vocab] (contiguous) against targets [rows]. Each row whose target is not
// `ignore` gets lse = log(sum(exp(logits))) and loss = lse - logits[target]; an ignored row
// gets 0 and 0. A target outside [0, vocab) that is not `ignore` fails a device assertion.
void cross_entropy_forward(Element element, int device, const void* logits, const int64_t* targets, int64_t ignore,
                           float* loss, float* lse, int64_t rows, int64_t vocab);

// grad_logits = (exp(logits - lse) - onehot(target)) * grad_loss[row] for every row, zero in
// an ignored row; grad_logits has the logits' type and layout.
void cross_entropy_backward(Element element, int device, const void* logits, const int64_t* targets, int64_t ignore,
                            const float* lse, const float* grad_loss, void* grad_logits, int64_t rows, int64_t vocab);

}  // namespace fsdpp::kernels
