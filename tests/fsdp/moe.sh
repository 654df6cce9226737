#!/usr/bin/env bash
# MoE models trained sharded equal one process. Qwen3-MoE (96 experts, 2 per token) on 8-token
# rows: at world 3 a rank routes 4 x 8 x 2 = 64 slots per micro-batch, so at least 32 experts
# get no token on each rank, and must still join every collective with a zero gradient. The
# loss carries the load-balancing loss, whose counts are summed over the ranks; the logged
# load-balancing loss and expert load must equal one process's at every step. Then with
# accumulation, each layer's experts a unit of their own (gathered over 2 ranks in backward)
# and the layers around them recomputed in backward. DeepSeek-V3 (latent attention, 96
# experts in 4 groups, a shared expert) alike, with its routing biases moved after every step
# from the counts over all ranks; the biases must have moved, by whole steps of the rate. Its
# routers then get units of their own that free their weights and biases after forward. A
# Qwen3-MoE file whose layers are all dense trains as the dense model it is.
# Those run in float64, where experts compute one product each; a float32 Qwen3-MoE runs them
# as one grouped product.
set -euo pipefail
: "${FSDPP:?}" "${PYTHON:?}" "${WORK:?}"
mkdir -p "$WORK"
moe=(--set 'model.path="tests/assets/models/fsdp-qwen3-moe"' --set data.seq_len=8 --metric aux_loss --metric expert_load)
"$PYTHON" tests/fsdp/check_fsdp.py 2 3 --name moe "${moe[@]}"
# The same model as transformers 5 saves it (num_local_experts, rope_parameters, its own
# initial weights), trained from those weights.
saved="$WORK/fsdp/moe-transformers5"
"$PYTHON" - tests/assets/models/fsdp-qwen3-moe "$saved" <<'PY'
import sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1])).save_pretrained(sys.argv[2])
PY
"$PYTHON" tests/fsdp/check_fsdp.py 2 --name moe-transformers5 --set "model.path=\"$saved\"" --set data.seq_len=8 \
  --metric aux_loss
# Every layer dense (mlp_only_layers naming them all): nothing is routed and no balance kept.
dense="$WORK/fsdp/moe-all-dense"
"$PYTHON" - tests/assets/models/fsdp-qwen3-moe "$dense" <<'PY'
import sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.from_pretrained(sys.argv[1])
config.mlp_only_layers = list(range(config.num_hidden_layers))
torch.manual_seed(0)
AutoModelForCausalLM.from_config(config).save_pretrained(sys.argv[2])
PY
"$PYTHON" tests/fsdp/check_fsdp.py 2 --name moe-all-dense --set "model.path=\"$dense\"" --set data.seq_len=8
"$PYTHON" tests/fsdp/check_fsdp.py 2 4 --name moe-expert-units "${moe[@]}" --set train.grad_accum=2 \
  --tested-set 'policy.options.experts="unit"' --tested-set policy.options.experts_reshard_after_forward=2 \
  --tested-set policy.options.activation_checkpoint=true
# The same Qwen3-MoE in float32 at widths whose rows are multiples of 16 bytes, so that each
# layer's experts run as one grouped product (models/moe.h) while FSDP frees their weights
# after forward and gathers them again for backward, in units of their own and recomputed:
# held to 100 times the run's own rounding noise, measured as world 2's gap from one process
# (itself required under 1e-3; measured 1.0e-5 to 2.6e-5 in weights).
grouped=(--set 'model.path="tests/assets/models/fsdp-qwen3-moe-grouped"' --set data.seq_len=8)
"$PYTHON" tests/fsdp/check_fsdp.py 3 4 --name moe-grouped --dtype float32 --floor-world 2 --floor-factor 100 --floor-limit 1e-3 \
  "${grouped[@]}" --tested-set 'policy.options.experts="unit"' --tested-set policy.options.activation_checkpoint=true
deepseek=(--set 'model.path="tests/assets/models/fsdp-deepseek-v3"' --set data.seq_len=8 --set experts.bias_update_rate=0.01
  --metric expert_load)
"$PYTHON" tests/fsdp/check_fsdp.py 2 3 --name deepseek "${deepseek[@]}"
"$PYTHON" tests/fsdp/check_fsdp.py 2 --name deepseek-router-units "${deepseek[@]}" \
  --tested-set 'policy.name="tests/assets/policies/router_units.lua"'
"$PYTHON" - "$WORK/fsdp/deepseek/world3/model" <<'PY'
import sys
from safetensors.torch import load_file
biases = {k: v for k, v in load_file(sys.argv[1] + "/model.safetensors").items() if k.endswith("e_score_correction_bias")}
steps = [(v / 0.01).round() for v in biases.values()]
whole = all(((v / 0.01 - s).abs().max() < 1e-9) for v, s in zip(biases.values(), steps))
moved = all(s.abs().max() > 0 for s in steps) and all((s.abs() <= 10).all() for s in steps)
print(f"{'ok  ' if whole and moved else 'FAIL'} routing biases of {len(biases)} layers moved by whole steps of the "
      f"rate, at most one per step: {[int(s.abs().max()) for s in steps]} steps at most")
sys.exit(0 if whole and moved and len(biases) == 2 else 1)
PY
