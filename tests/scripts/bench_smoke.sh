#!/usr/bin/env bash
# One benchmark script, run end to end in its --smoke mode, fsdpp and its PyTorch peer alike,
# so that a change to the engine or to a shared helper cannot leave a benchmark broken until
# its next real run, which takes minutes. Usage: bench_smoke.sh SCRIPT [ARG...]
set -euo pipefail
: "${FSDPP:?}" "${PYTHON:?}"
script=${1:?usage: bench_smoke.sh SCRIPT [ARG...]}
shift
bash scripts/make_corpus.sh >/dev/null
case $script in
  *.py) run=("$PYTHON" "scripts/$script") ;;
  *.sh) run=(bash "scripts/$script") ;;
  *) echo "bench_smoke: $script is neither a .py nor a .sh script" >&2; exit 2 ;;
esac
log=$(mktemp)
trap 'rm -f "$log"' EXIT
SECONDS=0
if ! "${run[@]}" "$@" --smoke --fsdpp "$FSDPP" >"$log" 2>&1; then
  cat "$log" >&2
  echo "$script $* --smoke failed (its output is above)" >&2
  exit 1
fi
echo "$script $* --smoke: ok in $SECONDS s"
