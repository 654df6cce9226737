#!/usr/bin/env bash
# The chat fine-tuning example from a fresh machine: makes a small model, its tokenizer and
# chats of a checkable task (scripts/make_sft_example.py), prepares them with the tokenizer's
# chat template, fine-tunes examples/sft-chat.toml, and measures on held-out chats, before
# and after, the loss over the answers (fsdpp eval) and the share answered exactly
# (transformers generating from the exported model); fails unless both improved.
# Extra arguments go to `fsdpp train`. The environment may name FSDPP (the binary, then
# nothing is set up or built), SFT_DATA_DIR (default data/sft) and SFT_RUN_DIR (default
# runs/sft-chat).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ -z "${FSDPP:-}" ]; then
  ./scripts/setup.sh
  ./scripts/build.sh fsdpp
fi
fsdpp="${FSDPP:-./build/fsdpp}"
data="${SFT_DATA_DIR:-data/sft}"
run_dir="${SFT_RUN_DIR:-runs/sft-chat}"
.venv/bin/python scripts/make_sft_example.py "$data"
for part in train heldout; do
  .venv/bin/python scripts/prepare_data.py --tokenizer "$data/model" --out "$data/$part.tok" "$data/$part.jsonl"
done
# MODEL_DIR: the held-out loss, then the exact-match share, as JSON lines. transformers loads
# the tokenizer from MODEL_DIR too: after training, the export must carry it.
measure() {
  "$fsdpp" eval examples/sft-chat.toml --set "model.path=\"$1\"" --set "data.train=\"$data/train.tok\"" \
    --tokens "$data/heldout.tok" --json
  .venv/bin/python scripts/sft_exact_match.py "$1" "$data/heldout.jsonl"
}
before="$(measure "$data/model")"
rm -rf "$run_dir"  # the example's own run directory: each example trains afresh
"$fsdpp" train examples/sft-chat.toml --set "model.path=\"$data/model\"" --set "data.train=\"$data/train.tok\"" \
  --set "train.out_dir=\"$run_dir\"" "$@"
after="$(measure "$run_dir/model")"
.venv/bin/python - "$before" "$after" <<'PY'
import json, sys
(loss0, match0), (loss1, match1) = ([json.loads(l) for l in a.splitlines()] for a in sys.argv[1:])
print(f"sft example: held-out loss over {loss1['tokens']} answer tokens {loss0['loss']:.4f} -> {loss1['loss']:.4f}; "
      f"exact answers {100 * match0['exact_match']:.1f}% -> {100 * match1['exact_match']:.1f}% of {match1['chats']} chats")
sys.exit(0 if loss1["loss"] < loss0["loss"] and match1["exact_match"] > match0["exact_match"] else 1)
PY
