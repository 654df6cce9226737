#!/usr/bin/env bash
# A mesh that does not fit the world stops every rank with one message printing each
# factor, and the launcher exits 2 repeating that message as its own last line, naming the
# rank; ranks started by hand with other settings, another output directory, files of other
# contents or another world size stop naming each; a closed output pipe stops nothing.
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

# Ranks started by hand and given other settings stop on every rank after the rendezvous,
# naming the rank and each setting, where a step count that differs hung until timeout_s.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
by_hand() {  # RANK [--set ...]
  local rank=$1; shift
  RANK=$rank WORLD_SIZE=2 LOCAL_RANK=$rank LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$FSDPP" train tests/assets/fsdp-llama.toml --set "train.out_dir=\"$WORK/settings-run\"" \
    --set parallel.timeout_s=60 --set train.steps=4 "$@" >/dev/null 2>"$WORK/settings-$rank.err"
}
rm -rf "$WORK"/settings-*
by_hand 0 & first=$!
by_hand 1 --set optimizer.lr=0.5 --set train.steps=7
rc1=$?
wait $first
rc0=$?
said=$(grep '^fsdpp: error:' "$WORK/settings-0.err")
if [ $rc0 -eq 2 ] && [ $rc1 -eq 2 ] && grep -qF "rank 1 was given other settings than rank 0" <<<"$said" &&
   grep -qF "optimizer.lr: 0.5 (rank 0: " <<<"$said" && grep -qF "train.steps: 7 (rank 0: 4)" <<<"$said"; then
  echo "ok   ranks given other settings: $said"
else
  echo "FAIL ranks given other settings (exit $rc0, $rc1): $said"; cat "$WORK"/settings-*.err; status=1
fi

# So does a rank given another model: a copy of config.json with another rope_theta, and
# another initializer_range (each rank draws its own rows of a fresh model from it). A copy
# that differs in what builds no other model (_name_or_path) trains.
rm -rf "$WORK"/settings-* "$WORK/other-model" "$WORK/same-model"
mkdir -p "$WORK/other-model" "$WORK/same-model"
python3 - tests/assets/models/fsdp-llama/config.json "$WORK" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
json.dump({**config, "_name_or_path": "elsewhere"}, open(sys.argv[2] + "/same-model/config.json", "w"))
json.dump({**config, "rope_theta": 12345.0, "initializer_range": 0.03}, open(sys.argv[2] + "/other-model/config.json", "w"))
PY
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
by_hand 0 & first=$!
by_hand 1 --set "model.path=\"$WORK/other-model\""
rc1=$?
wait $first
rc0=$?
said=$(grep '^fsdpp: error:' "$WORK/settings-0.err")
if [ $rc0 -eq 2 ] && [ $rc1 -eq 2 ] && grep -qF "rank 1 was given another model than rank 0 (rope_theta" <<<"$said" &&
   grep -qF "initializer_range 0.05 -> 0.03, from rank 0's config.json to rank 1's" <<<"$said"; then
  echo "ok   a rank given another model: $said"
else
  echo "FAIL a rank given another model (exit $rc0, $rc1): $said"; cat "$WORK"/settings-*.err; status=1
fi
rm -rf "$WORK"/settings-*
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
by_hand 0 --set train.steps=2 --set checkpoint.save_final=false & first=$!
by_hand 1 --set train.steps=2 --set checkpoint.save_final=false --set "model.path=\"$WORK/same-model\""
rc1=$?
wait $first
rc0=$?
if [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ]; then
  echo "ok   a rank given a copy of the model's config.json that builds the same model trains"
else
  echo "FAIL a copy of config.json that builds the same model (exit $rc0, $rc1)"; cat "$WORK"/settings-*.err; status=1
fi

# Ranks that would write apart (another out_dir) stop before the steps whose save would fail,
# and so do ranks given files of other contents at any path: another token file here.
refused_by_hand() {  # NAME WORDS... -- RANK 1'S SETTINGS...
  local name=$1 words=() said; shift
  while [ "$1" != "--" ]; do words+=("$1"); shift; done; shift
  rm -rf "$WORK"/settings-*
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  by_hand 0 & first=$!
  by_hand 1 "$@"
  rc1=$?
  wait $first
  rc0=$?
  said=$(grep '^fsdpp: error:' "$WORK/settings-0.err")
  local ok=$(( rc0 == 2 && rc1 == 2 ))
  for word in "${words[@]}"; do grep -qF -- "$word" <<<"$said" || ok=0; done
  if [ $ok -eq 1 ]; then
    echo "ok   $name: $said"
  else
    echo "FAIL $name (exit $rc0, $rc1): $said"; cat "$WORK"/settings-*.err; status=1
  fi
}
refused_by_hand "a rank given another out_dir" "rank 1 was given other settings than rank 0" \
  "train.out_dir: $WORK/elsewhere (rank 0: $WORK/settings-run)" -- --set "train.out_dir=\"$WORK/elsewhere\""
cp data/licenses.tok "$WORK/other.tok"
printf '\x0b' | dd of="$WORK/other.tok" bs=1 seek=$(( $(stat -c %s "$WORK/other.tok") - 2 )) conv=notrunc status=none
refused_by_hand "a rank given a token file of other contents" \
  "rank 1 was given other files than rank 0, and every rank must train from the same contents: [data] train's contents" \
  -- --set "data.train=\"$WORK/other.tok\""

# Ranks started for worlds of other sizes stop at the rendezvous naming both sizes, where
# each would time out on its own words.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
by_world() {  # RANK WORLD_SIZE
  RANK=$1 WORLD_SIZE=$2 LOCAL_RANK=$1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$FSDPP" train tests/assets/fsdp-llama.toml --set "train.out_dir=\"$WORK/worlds\"" \
    --set parallel.timeout_s=60 >/dev/null 2>"$WORK/worlds-$1.err"
}
by_world 0 2 & first=$!
by_world 1 3
rc1=$?
wait $first
rc0=$?
said=$(grep '^fsdpp: error:' "$WORK/worlds-0.err")
if [ $rc0 -eq 2 ] && [ $rc1 -eq 2 ] &&
   grep -qF "rank 0 was started for a world of 2 ranks, but rank 1 for one of 3" <<<"$said" &&
   grep -qF "rank 1 was started for a world of 3 ranks, but rank 0 for one of 2" "$WORK/worlds-1.err"; then
  echo "ok   ranks started for worlds of other sizes: $said"
else
  echo "FAIL ranks started for worlds of other sizes (exit $rc0, $rc1): $said"; cat "$WORK"/worlds-*.err; status=1
fi

# A reader of the launcher's output that goes away (`| head -1`) ends neither the launcher
# nor its ranks: the run trains to its end and exports.
rm -rf "$WORK/closed-pipe"
"$FSDPP" launch --nproc-per-node 2 -- train tests/assets/fsdp-llama.toml --set train.steps=3 \
  --set "train.out_dir=\"$WORK/closed-pipe\"" 2>&1 | head -1 >/dev/null
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 0 ] && [ -f "$WORK/closed-pipe/model/config.json" ]; then
  echo "ok   a closed output pipe: launch exit $rc, the model exported"
else
  echo "FAIL a closed output pipe: launch exit $rc"; status=1
fi
exit $status
