#!/usr/bin/env bash
# Runs never mix in one [train] out_dir: a second run starting afresh where a run saved its
# checkpoints, or where a run of other settings trained, is refused (resuming is the way on),
# and so is another model's run; resumed, the run may change its settings and is told which
# (and how its learning rate moves where it changes [train] steps);
# [train] reuse_out_dir = true trains beside them anyway, each run writing checkpoints,
# metrics and TensorBoard events of its own, and resume = "latest" then picks only the
# checkpoints of this run's settings (a run that would start afresh over its own, or save a step another saved in a
# [checkpoint] dir they share, is refused at start); a [checkpoint] dir outside out_dir holds the
# run's own by the out_dir they record. Each refusal is one line with exit status 2,
# and leaves the run's record (run.json) as it was.
set -uo pipefail
: "${FSDPP:?}" "${WORK:?}"
mkdir -p "$WORK"
bash scripts/make_corpus.sh >/dev/null
out="$WORK/out-dir"
rm -rf "$out"
run=(train tests/assets/fsdp-llama.toml --set "train.out_dir=\"$out\"" --set train.steps=2 --set metrics.progress='"never"')
failures=0
check() {  # NAME EXPECTED-EXIT PATTERN -- ARGS...: the run's exit status and its last stderr line
  local name=$1 want=$2 pattern=$3
  shift 4
  "$FSDPP" "$@" >"$out.log" 2>&1
  local rc=$? errors
  errors=$(grep -c '^fsdpp: error:' "$out.log")
  if [ "$rc" = "$want" ] && grep -qF -- "$pattern" "$out.log" && { [ "$want" = 0 ] || [ "$errors" = 1 ]; }; then
    echo "ok   $name: $(grep -F -- "$pattern" "$out.log" | head -1)"
  else
    echo "FAIL $name (exit $rc, wanted $want and '$pattern'):"; tail -3 "$out.log"; failures=$((failures + 1))
  fi
}
check "a first run records itself" 0 "done: 2 steps" -- "${run[@]}"
check "the same run afresh over its checkpoints" 2 \
  "checkpoints: holds the checkpoints of this run (up to step 2); resume it ([checkpoint] resume = \"latest\"), or choose another [train] out_dir, or set [train] reuse_out_dir = true to train beside it" \
  -- "${run[@]}"
check "the same run resumed" 0 "continuing after step 2" -- "${run[@]}" --set train.steps=3 --set 'checkpoint.resume="latest"'
# A refused resume leaves the run's record as it was: the next resume compares with the
# settings the run trained with.
cp "$out/run.json" "$out.record"
check "a resume over windows of another length" 2 "counts windows of a stream with seq_len = 32, but this run has 16 (the same window index would name different tokens); to go on from its weights over other data, name the checkpoint as [model] path" \
  -- "${run[@]}" --set train.steps=4 --set 'checkpoint.resume="latest"' --set data.seq_len=16
cmp -s "$out/run.json" "$out.record" || { echo "FAIL: a refused resume rewrote run.json"; failures=$((failures + 1)); }
check "other settings afresh" 2 \
  "$out: holds a run of this model and data with other settings (policy.options.lora_rank (unset) -> 2): resume it" \
  -- "${run[@]}" --set policy.options.lora_rank=2
check "another model's run" 2 "$out: holds another run (model" \
  -- "${run[@]}" --set 'model.path="examples/models/tiny-llama"' --set 'checkpoint.resume="latest"'
check "the run resumed with another learning rate and batch size" 0 \
  "the run goes on with other settings than it had: data.batch_size 12 -> 6, optimizer.lr 0.01 -> 0.005" \
  -- "${run[@]}" --set train.steps=4 --set 'checkpoint.resume="latest"' --set optimizer.lr=5e-3 --set data.batch_size=6
grep -q "continuing after step 3" "$out.log" || { echo "FAIL: the changed run did not resume step 3"; failures=$((failures + 1)); }
# Beside them on request: the run keeps its checkpoints under checkpoints-<its settings'
# hash>, so "latest" finds none of its own (the full run's steps 2 to 4 are not), and it
# starts afresh; its own step 1 is then the one it resumes, though the other's step 4 is newer.
beside=(--set policy.options.lora_rank=2 --set train.reuse_out_dir=true --set 'checkpoint.resume="latest"'
        --set checkpoint.keep=0)
first_events=$(ls "$out/tensorboard" | wc -l)
check "another run beside, resuming none of the first's" 0 "done: 1 steps" -- "${run[@]}" "${beside[@]}" --set train.steps=1
if grep -q "continuing after" "$out.log"; then echo "FAIL: resumed another run's checkpoint"; failures=$((failures + 1)); fi
check "its own latest, beside the other's" 0 "continuing after step 1" -- "${run[@]}" "${beside[@]}" --set train.steps=5
# Each keeps its own metrics: the first run's steps 1-4 in metrics.jsonl, this one's 1-5 in
# the file its log names.
own_metrics=$(sed -n 's/.* metrics: \(.*metrics-[0-9a-f]*\.jsonl\)$/\1/p' "$out.log")
if [ "$(grep -c '"grad_norm"' "$out/metrics.jsonl")" != 4 ] || [ -z "$own_metrics" ] ||
   [ "$(grep -c '"grad_norm"' "$own_metrics")" != 5 ]; then
  echo "FAIL: runs beside each other mixed their metrics ('$own_metrics')"; failures=$((failures + 1))
fi
# And its TensorBoard events (one file per run), under the same hash, where TensorBoard would
# show the two runs' steps as one series; the first run's directory gains none.
own_events=${own_metrics%.jsonl}
own_events="$out/tensorboard-${own_events##*metrics-}"
if [ "$(ls "$own_events" 2>/dev/null | grep -c '^events\.out\.tfevents\.')" != 2 ] ||
   [ "$(ls "$out/tensorboard" | wc -l)" != "$first_events" ]; then
  echo "FAIL: runs beside each other mixed their TensorBoard events: $(ls -d "$out"/tensorboard*)"
  failures=$((failures + 1))
fi
# Its adapter goes to a directory of its own settings, and run.json stays the first run's.
adapters=$(ls -d "$out"/adapter-* 2>/dev/null | wc -l)
if [ "$adapters" != 1 ] || [ -e "$out/adapter" ] || grep -q lora_rank "$out/run.json"; then
  echo "FAIL: the run beside took the first run's outputs or record ($adapters adapter-* directories)"
  failures=$((failures + 1))
fi
if [ "$(ls -d "$out"/checkpoints-*/step-00000005 2>/dev/null | wc -l)" != 1 ] ||
   [ "$(ls "$out/checkpoints")" != "$(printf 'step-00000002\nstep-00000003\nstep-00000004')" ]; then
  echo "FAIL: the run beside saved among the first run's checkpoints: $(ls "$out" "$out/checkpoints")"
  failures=$((failures + 1))
fi
# Refused before either trains rather than at their saves: the run beside started afresh over
# its own checkpoints, and a run that would save a step another run saved in a [checkpoint]
# dir they share.
check "the run beside, afresh over its own checkpoints" 2 \
  "holds this run's checkpoint step-00000001, which it would start afresh over; resume it" \
  -- "${run[@]}" --set policy.options.lora_rank=2 --set train.reuse_out_dir=true --set train.steps=2
check "a step another run saved in a shared [checkpoint] dir" 2 \
  "$out/checkpoints: holds another run's checkpoint step-00000002, a step this run would save too; choose another [checkpoint] dir" \
  -- "${run[@]}" --set optimizer.lr=0.02 --set train.reuse_out_dir=true --set "checkpoint.dir=\"$out/checkpoints\""
# In a [checkpoint] dir shared by choice, a run resuming after another run's step 2 saves
# only later steps: the other's steps 1 and 2 are no clash.
shared=(--set train.reuse_out_dir=true --set "checkpoint.dir=\"$out-shared\"" --set checkpoint.save_every=1)
rm -rf "$out-shared" "$out-a" "$out-b" "$out-c"
"$FSDPP" "${run[@]}" "${shared[@]}" --set "train.out_dir=\"$out-a\"" >"$out.log" 2>&1 ||
  { echo "FAIL: the run into a shared [checkpoint] dir"; failures=$((failures + 1)); }
check "a resume after another run's step in a shared [checkpoint] dir" 0 "continuing after step 2" \
  -- "${run[@]}" "${shared[@]}" --set "train.out_dir=\"$out-b\"" --set optimizer.lr=0.02 --set train.steps=3 \
  --set "checkpoint.resume=\"$out-shared/step-00000002\""
# A run beside others whose checkpoints lie in <out_dir>/checkpoints, where its own default
# is checkpoints-<hash>: "latest" would not find them and would start afresh.
"$FSDPP" "${run[@]}" --set train.reuse_out_dir=true --set "train.out_dir=\"$out-c\"" \
  --set "checkpoint.dir=\"$out-c/checkpoints\"" >"$out.log" 2>&1 || { echo "FAIL: the run into out-c"; failures=$((failures + 1)); }
check "checkpoints left in <out_dir>/checkpoints" 2 "$out-c/checkpoints: holds this run's step-00000002, where its checkpoints beside other runs go to $out-c/checkpoints-" \
  -- "${run[@]}" --set train.reuse_out_dir=true --set "train.out_dir=\"$out-c\"" --set train.steps=3 \
  --set 'checkpoint.resume="latest"'
# A run of 3 steps resumed to go on to 6: the cosine decay's end moves from step 3 to 6, so
# step 5 takes another rate than the run's end would have had (step 4 is at the peak either way).
longer=(train tests/assets/fsdp-llama.toml --set "train.out_dir=\"$out-longer\"" --set metrics.progress='"never"')
rm -rf "$out-longer"
"$FSDPP" "${longer[@]}" --set train.steps=3 >"$out.log" 2>&1 || { echo "FAIL: the 3-step run"; failures=$((failures + 1)); }
check "a resume that moves the schedule's end" 0 \
  "step-00000003: [train] steps 3 -> 6 moves the learning-rate schedule's end: step 5 takes " \
  -- "${longer[@]}" --set train.steps=6 --set 'checkpoint.resume="latest"'
# An export from before exports were marked, in the out_dir its run recorded itself in, is
# the run's own to replace: the run goes on.
"${PYTHON:-python3}" - "$out-longer/model/model.safetensors" <<'PY' || failures=$((failures + 1))
import json, struct, sys
data = open(sys.argv[1], "rb").read()
size = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + size])
del header["__metadata__"]["written_by"]
blob = json.dumps(header).encode()
blob += b" " * (-len(blob) % 8)
open(sys.argv[1], "wb").write(struct.pack("<Q", len(blob)) + blob + data[8 + size:])
PY
check "an unmarked export in its run's own out_dir" 0 "continuing after step 6" \
  -- "${longer[@]}" --set train.steps=7 --set 'checkpoint.resume="latest"'
# Checkpoints in a [checkpoint] dir outside out_dir are the run's by the out_dir they record:
# resumed with another learning rate, the run goes on from them as it would from its own.
outside=(train tests/assets/fsdp-llama.toml --set "train.out_dir=\"$out-outside\"" --set metrics.progress='"never"'
         --set "checkpoint.dir=\"$out-outside-checkpoints\"")
rm -rf "$out-outside" "$out-outside-checkpoints"
"$FSDPP" "${outside[@]}" --set train.steps=2 >"$out.log" 2>&1 || { echo "FAIL: the run saving outside"; failures=$((failures + 1)); }
check "a resume from a dir outside out_dir, with another learning rate" 0 "continuing after step 2" \
  -- "${outside[@]}" --set train.steps=3 --set 'checkpoint.resume="latest"' --set optimizer.lr=5e-3
# Metrics sent into a pipe: a resumed run has no records to read back from it, and does not
# wait there for a writer (two readers in turn take the two runs' records).
piped=(train tests/assets/fsdp-llama.toml --set "train.out_dir=\"$out-piped\"" --set metrics.progress='"never"'
       --set "metrics.jsonl=\"$out.fifo\"" --set 'checkpoint.resume="latest"')
rm -rf "$out-piped" "$out.fifo" && mkfifo "$out.fifo"
{ cat "$out.fifo"; cat "$out.fifo"; } >"$out.piped.jsonl" &
reader=$!
timeout 60 "$FSDPP" "${piped[@]}" --set train.steps=2 >"$out.log" 2>&1 &&
  timeout 60 "$FSDPP" "${piped[@]}" --set train.steps=3 >"$out.log" 2>&1 &&
  grep -q "continuing after step 2" "$out.log" && [ "$(grep -c '"grad_norm"' "$out.piped.jsonl")" = 3 ] ||
  { echo "FAIL: a resume writing its metrics into a pipe: $(tail -2 "$out.log")"; failures=$((failures + 1)); }
kill "$reader" 2>/dev/null
wait "$reader" 2>/dev/null
[ $failures = 0 ] && echo "runs never mix in one out_dir" || exit 1
