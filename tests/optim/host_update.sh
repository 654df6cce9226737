#!/usr/bin/env bash
# [optimizer] host_update = "overlapped": a host thread updates the masters that live in host
# memory unit by unit while the next forward begins. Every figure must be bitwise what updates
# in the step give: the losses, the held-out losses, the final weights and the checkpoints
# saved between steps (their rows and AdamW's moments), at world 1 and, offloaded, at world 2.
set -euo pipefail
: "${FSDPP:?}" "${PYTHON:?}" "${WORK:?}"
mkdir -p "$WORK"
both=(--dtype float32 --tolerance 0 --set data.eval_fraction=0.1 --set train.eval_every=3
      --set checkpoint.save_every=4 --set checkpoint.keep=0
      --tested-set 'optimizer.host_update="overlapped"' --reference-set 'optimizer.host_update="in_step"')
"$PYTHON" tests/fsdp/check_fsdp.py 1 --name host-update --reference-world 1 "${both[@]}"
"$PYTHON" tests/fsdp/check_fsdp.py 2 --name host-update-2 --reference-world 2 "${both[@]}" \
  --set 'policy.options.offload="cpu"'
"$PYTHON" - "$WORK/fsdp" <<'PY'
import os
import sys
import torch
from safetensors.torch import load_file
root, ok = sys.argv[1], True
for name, world in (("host-update", 1), ("host-update-2", 2)):
    for step in (4, 8):
        dirs = [os.path.join(root, name, run, "checkpoints", f"step-{step:08d}") for run in ("single", f"world{world}")]
        files = [sorted(f for f in os.listdir(d) if f.endswith(".safetensors")) for d in dirs]
        tensors = [[load_file(os.path.join(d, f)) for f in fs] for d, fs in zip(dirs, files)]
        same = files[0] == files[1] and len(files[0]) == world and all(
            a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(*tensors))
        ok &= same
        count = sum(len(t) for t in tensors[0])
        print(f"{'ok  ' if same else 'FAIL'} world {world}: the step-{step} checkpoint ({len(files[0])} rank files, "
              f"{count} tensors) saved with host updates overlapped is {'bitwise' if same else 'NOT'} in_step's")
sys.exit(0 if ok else 1)
PY
# The runs above took the path they name: the start-up log says so where the updates overlap.
line="6 of 6 units update on a host thread while the next forward begins"
for mode in overlapped in_step; do
  rm -rf "$WORK/fsdp/host-update-log-$mode"
  log=$("$FSDPP" train tests/assets/fsdp-llama.toml --set train.steps=1 --set "optimizer.host_update=\"$mode\"" \
        --set "train.out_dir=\"$WORK/fsdp/host-update-log-$mode\"" --set train.reuse_out_dir=true 2>&1)
  said=no
  grep -qF "$line" <<<"$log" && said=yes
  want=$([[ "$mode" == overlapped ]] && echo yes || echo no)
  [[ "$said" == "$want" ]] || { echo "FAIL host_update=$mode: start-up log says '$line': $said"; exit 1; }
  echo "ok   host_update=$mode: start-up log says '$line': $said"
done
