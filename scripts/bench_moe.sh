#!/usr/bin/env bash
# Mixture-of-experts training on the CPU, fsdpp against transformers + AdamW in the same run
# (scripts/bench_train.py: same initial weights, batches, threads and optimiser; the losses,
# load-balancing loss included, must agree): first a model of one MoE layer (32 experts, 4 per
# token; embeddings and head are a small share of its work), then a small MoE model
# (examples/tiny-qwen3-moe.toml), then a small DeepSeek-V3 (latent attention, 96 experts in 4
# groups, a shared expert: tests/assets/models/fsdp-deepseek-v3). Each prints tokens/s, peak
# RSS and the ratios.
# Run from the repository root after ./scripts/build.sh: bash scripts/bench_moe.sh [--smoke]
set -euo pipefail
python=${PYTHON:-.venv/bin/python}
bash scripts/make_corpus.sh >/dev/null
echo "== one MoE layer (examples/models/qwen3-moe-layer)"
"$python" scripts/bench_train.py --config examples/tiny-qwen3-moe.toml \
  --model-path examples/models/qwen3-moe-layer "$@"
echo
echo "== a small MoE model (examples/tiny-qwen3-moe.toml)"
"$python" scripts/bench_train.py --config examples/tiny-qwen3-moe.toml "$@"
echo
echo "== a small DeepSeek-V3 (tests/assets/models/fsdp-deepseek-v3)"
"$python" scripts/bench_train.py --config examples/tiny-qwen3-moe.toml \
  --model-path tests/assets/models/fsdp-deepseek-v3 "$@"
