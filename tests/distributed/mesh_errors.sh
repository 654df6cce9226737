#!/usr/bin/env bash
# A mesh that does not fit the world stops every rank with one message printing each
# factor, and the launcher exits 2 repeating that message as its own last line, naming the rank.
set -uo pipefail
: "${FSDPP:?}" "${WORK:?}"
mkdir -p "$WORK"
bash scripts/make_corpus.sh >/dev/null
status=0
check() {
  local ranks=$1 want=$2; shift 2
  local err
  err=$("$FSDPP" launch --nproc-per-node "$ranks" -- train tests/assets/fsdp-llama.toml \
        --set "train.out_dir=\"$WORK/mesh-errors\"" "$@" 2>&1 >/dev/null)
  local rc=$?
  if [ $rc -eq 2 ] && tail -1 <<<"$err" | grep -q '^fsdpp: error: rank [0-9]: ' && tail -1 <<<"$err" | grep -qF -- "$want"; then
    echo "ok   $*: $want"
  else
    echo "FAIL $* (exit $rc), wanted '$want':"; echo "$err"; status=1
  fi
}
check 4 "policies/llama.lua:4: mesh replicate 2 × shard 3 ≠ world 4" --set policy.options.replicate=2 --set policy.options.shard_size=3
check 4 "mesh: world 4 is not divisible by replicate 3" --set policy.options.replicate=3
check 5 "[data] batch_size 12 is not a multiple of the world size 5"
exit $status
