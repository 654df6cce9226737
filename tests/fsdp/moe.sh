#!/usr/bin/env bash
# A Qwen3-MoE model (96 experts, 2 per token) trained on 8-token rows equals one process. At
# world 3 a rank routes 4 x 8 x 2 = 64 slots per micro-batch, so at least 32 experts get no
# token on each rank, and must still join every collective with a zero gradient. The loss
# carries the load-balancing loss, whose counts are summed over the ranks. Then with
# accumulation, each layer's experts a unit of their own (gathered over 2 ranks in backward)
# and the layers around them recomputed in backward.
set -euo pipefail
: "${FSDPP:?}" "${PYTHON:?}" "${WORK:?}"
moe=(--set 'model.path="tests/assets/models/fsdp-qwen3-moe"' --set data.seq_len=8)
"$PYTHON" tests/fsdp/check_fsdp.py 2 3 --name moe "${moe[@]}"
"$PYTHON" tests/fsdp/check_fsdp.py 2 4 --name moe-expert-units "${moe[@]}" --set train.grad_accum=2 \
  --set 'policy.options.experts="unit"' --set policy.options.experts_reshard_after_forward=2 \
  --set policy.options.activation_checkpoint=true
