#!/usr/bin/env bash
# Every benchmark script runs end to end in its --smoke mode, fsdpp and its PyTorch peer
# alike, so that a change to the engine or to a shared helper cannot leave a benchmark broken
# until its next real run, which takes minutes.
set -euo pipefail
: "${FSDPP:?}" "${PYTHON:?}"
bash scripts/make_corpus.sh >/dev/null
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for bench in bench_fsdp.py bench_train.py bench_moe.sh bench_lora.sh bench_packing.py bench_checkpoint.py bench_plan.sh; do
  case $bench in
    *.py) run=("$PYTHON" "scripts/$bench") ;;
    *.sh) run=(bash "scripts/$bench") ;;
  esac
  SECONDS=0
  if ! "${run[@]}" --smoke --fsdpp "$FSDPP" >"$log" 2>&1; then
    cat "$log" >&2
    echo "$bench --smoke failed (its output is above)" >&2
    exit 1
  fi
  echo "$bench --smoke: ok in $SECONDS s"
done
