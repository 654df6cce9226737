#!/usr/bin/env bash
# The RL example from a fresh machine: the chat example's model, tokenizer and task
# (scripts/make_sft_example.py), a short supervised warm-up with `fsdpp train` so that some
# samples earn a reward, then examples/python/grpo_reverse.py: a GRPO-style loop in Python
# over the fsdpp package, which fails unless the mean reward rose. The environment may name
# FSDPP (the binary, built with the package beside it; nothing is set up or built then),
# GRPO_DATA_DIR (default data/grpo), GRPO_RUN_DIR (where grpo-warmup/ and grpo/ go; default
# runs), GRPO_WARMUP_STEPS (default 120) and GRPO_STEPS (default 40).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
if [ -z "${FSDPP:-}" ]; then
  ./scripts/setup.sh
  ./scripts/build.sh
fi
fsdpp="${FSDPP:-./build/fsdpp}"
data="${GRPO_DATA_DIR:-data/grpo}"
runs="${GRPO_RUN_DIR:-runs}"
.venv/bin/python scripts/make_sft_example.py "$data" >/dev/null
.venv/bin/python scripts/prepare_data.py --tokenizer "$data/model" --out "$data/train.tok" "$data/train.jsonl" >/dev/null
rm -rf "$runs/grpo-warmup" "$runs/grpo"  # the example's own run directories: each run starts afresh
"$fsdpp" train examples/sft-chat.toml --set "model.path=\"$data/model\"" --set "data.train=\"$data/train.tok\"" \
  --set "train.steps=${GRPO_WARMUP_STEPS:-120}" --set "train.out_dir=\"$runs/grpo-warmup\"" --set train.log_every=40
PYTHONPATH="$(dirname "$fsdpp")/python" .venv/bin/python examples/python/grpo_reverse.py "$runs/grpo-warmup/model" \
  --steps "${GRPO_STEPS:-40}" --out-dir "$runs/grpo"
