#!/usr/bin/env bash
# Every benchmark script runs end to end in its --smoke mode, fsdpp and its PyTorch peer
# alike, so that a change to the engine or to a shared helper cannot leave a benchmark broken
# until its next real run, which takes minutes.
set -euo pipefail
: "${FSDPP:?}" "${PYTHON:?}"
bash scripts/make_corpus.sh >/dev/null
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# bench_fsdp.py twice: dense with the compiled peer too, and a Qwen3-MoE whose peer adds the
# load-balancing loss over every rank, as fsdpp does, with both engines' kernels counted.
for bench in "bench_fsdp.py --compile" "bench_fsdp.py --config examples/tiny-qwen3-moe.toml --count-step 2" \
             bench_train.py bench_moe.sh \
             bench_lora.sh bench_packing.py bench_checkpoint.py bench_plan.sh; do
  read -r -a args <<<"$bench"
  case ${args[0]} in
    *.py) run=("$PYTHON" "scripts/${args[0]}") ;;
    *.sh) run=(bash "scripts/${args[0]}") ;;
  esac
  SECONDS=0
  if ! "${run[@]}" "${args[@]:1}" --smoke --fsdpp "$FSDPP" >"$log" 2>&1; then
    cat "$log" >&2
    echo "$bench --smoke failed (its output is above)" >&2
    exit 1
  fi
  echo "$bench --smoke: ok in $SECONDS s"
done
