#!/usr/bin/env bash
# One path for every run: `fsdpp train` as a plain process trains bitwise as `fsdpp launch
# --nproc-per-node 1 -- train` does, applying the policy's plan: bf16 compute over fp32
# masters, then with activation checkpointing, then offloaded; and its start-up log names the
# dtypes it computes and reduces in.
set -euo pipefail
: "${FSDPP:?}" "${PYTHON:?}" "${WORK:?}"
mkdir -p "$WORK"
bf16=(--dtype float32 --tolerance 0 --set 'policy.options.param_dtype="bfloat16"'
      --expect-log 'precision: compute bfloat16, reduce float32')
"$PYTHON" tests/fsdp/check_fsdp.py 1 --name one-path-bf16 "${bf16[@]}"
"$PYTHON" tests/fsdp/check_fsdp.py 1 --name one-path-ac "${bf16[@]}" --set policy.options.activation_checkpoint=true
"$PYTHON" tests/fsdp/check_fsdp.py 1 --name one-path-offload "${bf16[@]}" --set 'policy.options.offload="cpu"'
# The run's own export holds the fp32 masters, not their bf16 copies: bitwise the offline
# export of its last checkpoint.
run="$WORK/fsdp/one-path-bf16/single"
"$FSDPP" export "$run/checkpoints/step-00000010" "$run/offline" --dtype float32
"$PYTHON" - "$run" <<'PY'
import sys
import torch
from safetensors.torch import load_file
run = sys.argv[1]
streamed, offline = load_file(f"{run}/model/model.safetensors"), load_file(f"{run}/offline/model.safetensors")
same = streamed.keys() == offline.keys() and all(torch.equal(streamed[k], offline[k]) for k in offline)
rounded = all(torch.equal(t, t.bfloat16().float()) for t in streamed.values())
ok = same and not rounded
print(f"{'ok  ' if ok else 'FAIL'} the bf16 run's export equals its checkpoint's offline export bitwise: {same}; "
      f"every weight a bf16 value: {rounded}")
sys.exit(0 if ok else 1)
PY
