#!/usr/bin/env bash
# LoRA against full fine-tuning on the CPU at world 2, each against its peer in the same run
# (scripts/bench_fsdp.py): full fine-tuning, fsdpp against PyTorch's fully_shard; then LoRA
# rank 8 on the attention projections with the base frozen, fsdpp against peft + fully_shard,
# both from one PEFT adapter. Each prints median step time and every rank's peak RSS, with
# the ratios; set side by side, the two show what a frozen base saves in each engine.
# Run from the repository root after ./scripts/build.sh: bash scripts/bench_lora.sh [--smoke]
set -euo pipefail
python=${PYTHON:-.venv/bin/python}
bash scripts/make_corpus.sh >/dev/null
echo "== full fine-tuning"
"$python" scripts/bench_fsdp.py "$@"
echo
echo "== LoRA rank 8 on q_proj, k_proj, v_proj, o_proj"
"$python" scripts/bench_fsdp.py --lora-rank 8 "$@"
