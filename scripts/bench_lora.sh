#!/usr/bin/env bash
# LoRA against full fine-tuning on the CPU at world 2, each against its peer in the same run
# (scripts/bench_fsdp.py): full fine-tuning, fsdpp against PyTorch's fully_shard; then LoRA
# rank 8 on the attention projections with the base frozen, fsdpp against peft + fully_shard,
# both from one PEFT adapter; then LoRA on a wider model computing in bf16, where fsdpp holds
# the frozen base in bf16 alone and fully_shard keeps its fp32 sharded parameters. Each prints
# median step time and every rank's peak RSS, with the ratios; set side by side, they show
# what a frozen base saves in each engine.
# Run from the repository root after ./scripts/build.sh: bash scripts/bench_lora.sh [--smoke]
set -euo pipefail
python=${PYTHON:-.venv/bin/python}
bash scripts/make_corpus.sh >/dev/null
echo "== full fine-tuning"
"$python" scripts/bench_fsdp.py "$@"
echo
echo "== LoRA rank 8 on q_proj, k_proj, v_proj, o_proj"
"$python" scripts/bench_fsdp.py --lora-rank 8 "$@"
echo
# A wider model (25M parameters, short rows) for the bf16 run, so that the frozen base's
# shards outweigh the runtime in each rank's RSS.
wide=$(mktemp -d)
trap 'rm -rf "$wide"' EXIT
"$python" - "$wide" <<'PY'
import json, sys
wide = sys.argv[1]
config = json.load(open("examples/models/tiny-llama/config.json"))
config.update(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=16,
              num_key_value_heads=4)
json.dump(config, open(f"{wide}/config.json", "w"), indent=2)
toml = open("examples/tiny-llama.toml").read()
for old, new in (('"examples/models/tiny-llama"', f'"{wide}"'), ("seq_len = 128", "seq_len = 32"),
                 ("batch_size = 8", "batch_size = 4")):
    assert old in toml, old
    toml = toml.replace(old, new)
open(f"{wide}/wide.toml", "w").write(toml)
PY
echo "== LoRA rank 8 on q_proj, k_proj, v_proj, o_proj of a 25M-parameter Llama, computing in bf16"
steps=(--steps 12)  # a bf16 step takes seconds on a CPU; --smoke keeps its own few
[[ " $* " == *" --smoke "* ]] && steps=()
"$python" scripts/bench_fsdp.py --config "$wide/wide.toml" --lora-rank 8 --param-dtype bfloat16 "${steps[@]}" "$@"
