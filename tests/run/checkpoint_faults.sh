#!/usr/bin/env bash
# Checkpoints under faults, at world 2:
#  - a save killed with SIGKILL mid-write (rank 1) or just before its commit (rank 0) leaves
#    the previous checkpoint loadable, is never taken as the latest, and resuming works;
#  - SIGTERM to the launcher ends the run with a checkpoint of the step it was on and exit
#    status 143, and resuming continues after that step; so does one sent to the launcher and
#    every rank at once; one raised during a step, during
#    the evaluation after it, or during its periodic save, stops the run after that step; a
#    second signal of the other kind ends the process at once;
#  - a save that fails on one rank names that rank and why, not a rank that saw it fail;
#  - an older checkpoint that cannot all be rotated away is a warning, not the run's end;
#  - a second job into the out_dir of a run still training is refused, and so is a resume
#    from a checkpoint older than one of the run's own beside it;
#  - a flipped byte, a missing rank file, a truncated rank file and a checkpoint renamed to
#    another step are refused with one
#    error naming the file, by `fsdpp export` and by a resumed run; so is a resume over a
#    token file rewritten in place, into a file of documents, or into a model that computes
#    otherwise than the one saved;
#  - a disk with no room for one checkpoint is refused at start (where a small filesystem can
#    be mounted).
set -uo pipefail
: "${FSDPP:?}" "${WORK:?}" "${PYTHON:?}"
bash scripts/make_corpus.sh >/dev/null
out="$WORK/checkpoint-faults"
rm -rf "$out" && mkdir -p "$out"
status=0
fail() { echo "FAIL: $*"; status=1; }
train() {  # train OUT_DIR [--set ...]: world 2, checkpoints every 5 steps
  local dir=$1; shift
  "$FSDPP" launch --nproc-per-node 2 -- train tests/assets/fsdp-llama.toml --set "train.out_dir=\"$dir\"" \
    --set checkpoint.save_every=5 --set 'checkpoint.resume="latest"' "$@"
}

for point in checkpoint-mid-write:1 checkpoint-before-commit:0; do
  name=${point%:*} rank=${point#*:}
  run="$out/$name"
  train "$run" --set train.steps=5 >"$run.first.log" 2>&1 || fail "$name: the first run failed"
  FSDPP_FAILPOINT=$name FSDPP_FAILPOINT_RANK=$rank train "$run" >"$run.crash.log" 2>&1
  rc=$?
  [ "$rc" -ne 0 ] || fail "$name: the killed save exited 0"
  grep -q "rank $rank failed with signal Killed" "$run.crash.log" || fail "$name: rank $rank was not killed"
  ls -a "$run/checkpoints" | grep -q '^\.partial-step-00000010$' || fail "$name: no partial step 10 left behind"
  [ ! -e "$run/checkpoints/step-00000010" ] || fail "$name: the killed save was committed"
  "$FSDPP" export "$run/checkpoints/step-00000005" "$run/export" >/dev/null 2>&1 ||
    fail "$name: the previous checkpoint no longer exports"
  train "$run" >"$run.resume.log" 2>&1 || fail "$name: resuming failed"
  grep -q 'continuing after step 5' "$run.resume.log" || fail "$name: resume did not pick step 5"
  [ -e "$run/checkpoints/step-00000010" ] || fail "$name: the resumed run saved no step 10"
  ls -a "$run/checkpoints" | grep -q '^\.partial' && fail "$name: the partial save was not cleared"
  echo "ok   killed at $name (rank $rank, launcher exit $rc): step 5 intact, resumed to step 10"
done

# A world-2 run of no end in the background ($launcher), once it has recorded step STEP.
start_long_run() {  # RUN STEP [--set ...]
  local dir=$1 step=$2; shift 2
  "$FSDPP" launch --nproc-per-node 2 -- train tests/assets/fsdp-llama.toml --set "train.out_dir=\"$dir\"" \
    --set train.steps=100000 "$@" >"$dir.log" 2>&1 &
  launcher=$!
  for _ in $(seq 1 300); do
    grep -q "\"step\":$step" "$dir/metrics.jsonl" 2>/dev/null && break
    sleep 0.1
  done
}
# The newest checkpoint of RUN, and the last step its metrics recorded.
saved_and_last() {  # RUN
  saved=$(ls "$1/checkpoints" 2>/dev/null | tail -1)
  last=$(tail -1 "$1/metrics.jsonl" | sed 's/.*"step":\([0-9]*\).*/\1/')
}

# SIGTERM mid-run: the step in flight finishes, is saved, and the job exits 128 + 15.
run="$out/sigterm"
start_long_run "$run" 4
# A second job into the same out_dir while this one trains is refused, naming the holder.
train "$run" --set train.steps=100000 >"$run.second.log" 2>&1
second=$?
holder=$(grep '^fsdpp: error:' "$run.second.log")
[ "$second" -eq 2 ] && [ "$(grep -c '^fsdpp: error:' "$run.second.log")" -eq 1 ] &&
  [[ "$holder" == *"$run: another run is training in this [train] out_dir (process "* ]] ||
  fail "a second job into a training out_dir: exit $second: $(tail -2 "$run.second.log")"
echo "ok   a second job into the same out_dir: $holder"
kill -TERM $launcher
wait $launcher
rc=$?
saved_and_last "$run"
[ "$rc" -eq 143 ] || fail "SIGTERM: launcher exited $rc, not 143"
grep -qF "fsdpp: SIGTERM: finishing the step in flight and saving it; a second signal stops at once, unsaved" "$run.log" ||
  fail "SIGTERM: no rank said it would finish the step and save"
[ "$saved" = "$(printf 'step-%08d' "$last")" ] || fail "SIGTERM: saved '$saved' but the last step was $last"
train "$run" --set train.steps=$((last + 2)) --set checkpoint.save_every=0 >"$run.resume.log" 2>&1 ||
  fail "SIGTERM: resuming failed"
grep -q "continuing after step $last" "$run.resume.log" || fail "SIGTERM: resume did not continue after step $last"
echo "ok   SIGTERM after step $last: exit $rc, $saved saved, resumed to step $((last + 2))"

# A job's scheduler (Slurm's scancel, systemd stopping a unit) signals the launcher and every
# rank at once: each rank is told of the one stop twice, directly and passed on by the
# launcher, and takes it as one, finishing its step and saving it.
run="$out/sigterm-every-process"
start_long_run "$run" 2
kill -TERM $launcher $(pgrep -P $launcher)
wait $launcher
rc=$?
saved_and_last "$run"
if [ "$rc" -eq 143 ] && [ "$saved" = "$(printf 'step-%08d' "$last")" ]; then
  echo "ok   SIGTERM to the launcher and every rank at once: exit $rc, $saved saved"
else
  fail "SIGTERM to the launcher and every rank at once: exit $rc, saved '$saved', last step $last:" \
    "$(grep -v ' info ' "$run.log" | tail -2)"
fi

# A stop signal that arrives during a step (rank 1 raises SIGTERM in step 1's forward), during
# the evaluation after step 2, or during the periodic save of step 5 (SIGINT; the ranks vote
# again once either is over), stops the run after that step, not after the next: a second
# signal there would kill rank 1. Every rank, and the launcher, exit on the signal rank 1
# caught, though rank 0 caught none.
stop_within() {  # NAME FAILPOINT STEP SIGNAL [--set ...]: the step saved alone, exit 128 + SIGNAL
  local name=$1 point=$2 step=$3 signal=$4 want said rc saved run
  want=$(printf 'step-%08d ' "$step")
  case $signal in TERM) said=Terminated ;; INT) said=Interrupt ;; esac
  shift 4
  run="$out/$point"
  FSDPP_FAILPOINT=$point FSDPP_FAILPOINT_RANK=1 train "$run" --set train.steps=100 "$@" >"$run.log" 2>&1
  rc=$?
  saved=$(ls "$run/checkpoints" 2>/dev/null | tr '\n' ' ')
  [ "$rc" -eq $((128 + $(kill -l "$signal"))) ] ||
    fail "SIG$signal $name: launcher exited $rc: $(grep -v ' info ' "$run.log" | tail -2)"
  grep -q "^\[rank 0\] .*stopped by $said after step $step" "$run.log" &&
    grep -q "^fsdpp launch: every rank stopped after $said" "$run.log" ||
    fail "SIG$signal $name: not reported as stopped by $said: $(grep -v ' info ' "$run.log" | tail -2)"
  [ "$saved" = "$want" ] || fail "SIG$signal $name: saved '$saved', not ${want% } alone"
  echo "ok   SIG$signal $name: exit $rc, ${saved% } saved"
}
stop_within "during step 1" signal-mid-step 1 TERM
stop_within "during the evaluation after step 2" signal-mid-eval 2 TERM --set train.eval_every=2 --set data.eval_fraction=0.1
stop_within "during the save of step 5" signal-mid-save 5 INT
# The same without a launcher: one process stops after the step it was saving.
run="$out/signal-mid-save-alone"
FSDPP_FAILPOINT=signal-mid-save "$FSDPP" train tests/assets/fsdp-llama.toml --set "train.out_dir=\"$run\"" \
  --set checkpoint.save_every=5 --set train.steps=100 >"$run.log" 2>&1
rc=$?
saved=$(ls "$run/checkpoints" 2>/dev/null | tr '\n' ' ')
if [ "$rc" -eq 130 ] && [ "$saved" = "step-00000005 " ] && grep -q "stopped by Interrupt after step 5" "$run.log"; then
  echo "ok   SIGINT during the save of step 5, one process: exit $rc, ${saved% } saved"
else
  fail "SIGINT during the save of step 5, one process: exit $rc, saved '$saved'"
fi
# Two stop signals of different kinds: the second ends the rank at once, unsaved, as a second
# of the same kind does. Rank 1 is held stopped, so rank 0 waits in a collective meanwhile.
run="$out/two-signals"
start_long_run "$run" 2 --set parallel.timeout_s=60
declare -A rank_pid
for pid in $(pgrep -P $launcher); do
  rank_pid[$(tr '\0' '\n' <"/proc/$pid/environ" | sed -n 's/^RANK=//p')]=$pid
done
alive() { [ -e "/proc/$1" ] && [ "$(awk '/^State/ {print $2}' "/proc/$1/status" 2>/dev/null)" != Z ]; }
kill -STOP "${rank_pid[1]}"
kill -INT "${rank_pid[0]}"
for _ in $(seq 1 200); do  # its handler ran
  grep -qF "[rank 0] fsdpp: SIGINT: finishing the step" "$run.log" && break
  sleep 0.05
done
kill -TERM "${rank_pid[0]}"
for _ in $(seq 1 200); do alive "${rank_pid[0]}" || break; sleep 0.05; done
if alive "${rank_pid[0]}"; then
  fail "SIGINT then SIGTERM: rank 0 still runs after the second signal: $(grep -v ' info ' "$run.log" | tail -2)"
else
  echo "ok   SIGINT then SIGTERM: the second ended rank 0 at once"
fi
kill -CONT "${rank_pid[1]}"
wait $launcher

# A save that fails on rank 1 (a full disk there) stops every rank; the launcher's one error
# line is rank 1's, which says why, not rank 0's report that another rank failed.
run="$out/write-error"
FSDPP_FAILPOINT=checkpoint-write-error FSDPP_FAILPOINT_RANK=1 train "$run" >"$run.log" 2>&1
rc=$?
said=$(grep '^fsdpp: error:' "$run.log")
if [ "$rc" -eq 2 ] && [ "$(grep -c '^fsdpp: error:' "$run.log")" -eq 1 ] &&
   [[ "$said" == "fsdpp: error: rank 1: save: failpoint checkpoint-write-error fails here"* ]]; then
  echo "ok   a save failing on rank 1: exit $rc, $said"
else
  fail "a save failing on rank 1: exit $rc, $said"
fi

# An older checkpoint whose files cannot all be deleted (one made immutable) is a warning:
# the one just saved is complete, and the run goes on to its end and its export; the next
# run's clean-up removes what is left.
run="$out/rotate-error"
FSDPP_FAILPOINT=checkpoint-rotate-error train "$run" --set train.steps=10 --set checkpoint.keep=1 >"$run.log" 2>&1
rc=$?
if [ "$rc" -eq 0 ] && grep -q "step-00000005 is not all removed yet: failpoint checkpoint-rotate-error" "$run.log" &&
   [ -d "$run/checkpoints/.deleting-step-00000005" ] && [ -d "$run/checkpoints/step-00000010" ] &&
   [ -f "$run/model/config.json" ]; then
  echo "ok   an older checkpoint that cannot all be removed: exit 0, a warning, step 10 and the export there"
else
  fail "an older checkpoint that cannot all be removed: exit $rc: $(grep -E 'warn|error' "$run.log" | tail -3)"
fi
train "$run" --set train.steps=15 --set checkpoint.keep=1 >"$run.next.log" 2>&1 || fail "rotate-error: the next run failed"
[ ! -e "$run/checkpoints/.deleting-step-00000005" ] || fail "rotate-error: the next run left .deleting-step-00000005"

# Corrupt checkpoints: each refused with exactly one error line naming the damaged file.
good="$out/checkpoint-mid-write/checkpoints/step-00000005"
expect_refused() {  # NAME FILE_IN_MESSAGE WORDS -- COMMAND...
  local name=$1 file=$2 words=$3; shift 4
  "$@" >"$out/refused.out" 2>"$out/refused.err"
  local rc=$? errors
  errors=$(grep -c '^fsdpp: error:' "$out/refused.err")
  if [ "$rc" -ne 2 ] || [ "$errors" -ne 1 ] || ! grep '^fsdpp: error:' "$out/refused.err" | grep -q "$file.*$words"; then
    fail "$name: exit $rc, $errors error line(s): $(tail -2 "$out/refused.err")"
  else
    echo "ok   $name: $(grep '^fsdpp: error:' "$out/refused.err")"
  fi
}
for damage in flipped missing truncated; do
  bad="$out/$damage/step-00000005"
  mkdir -p "$out/$damage" && cp -r "$good" "$bad"
  case $damage in
    flipped) # every bit of one byte of tensor data mid-file, well past the header
             file="$bad/rank-00001.safetensors" at=$(( $(stat -c %s "$bad/rank-00001.safetensors") / 2 ))
             byte=$(od -An -tu1 -j "$at" -N1 "$file" | tr -d ' ')
             printf "\\x$(printf %02x $((byte ^ 255)))" | dd of="$file" bs=1 seek="$at" conv=notrunc 2>/dev/null
             words="checksum" ;;
    missing) rm "$bad/rank-00001.safetensors"; words="missing" ;;
    truncated) truncate -s -64 "$bad/rank-00001.safetensors"; words="truncated" ;;
  esac
  expect_refused "export of a checkpoint with a $damage rank file" "rank-00001.safetensors" "$words" -- \
    "$FSDPP" export "$bad" "$out/$damage/export"
done
# A run finds its checkpoints by name: one renamed to another step is refused, naming both.
mkdir -p "$out/renamed" && cp -r "$good" "$out/renamed/step-00000009"
expect_refused "export of a checkpoint renamed to another step" "step-00000009" "is named step 9 but holds step 5" -- \
  "$FSDPP" export "$out/renamed/step-00000009" "$out/renamed/export"
expect_refused "the same, named with a trailing slash" "step-00000009" "is named step 9 but holds step 5" -- \
  "$FSDPP" export "$out/renamed/step-00000009/" "$out/renamed/export"
expect_refused "resume from a checkpoint with a flipped byte" "rank-00001.safetensors" "checksum" -- \
  "$FSDPP" launch --nproc-per-node 2 -- train tests/assets/fsdp-llama.toml --set "train.out_dir=\"$out/flipped/run\"" \
  --set "checkpoint.resume=\"$out/flipped/step-00000005\""
# A damaged newest checkpoint stops a restart's resume = "latest", saying how to go on: move
# it away, and the one before it is the newest.
cp -r "$out/checkpoint-mid-write" "$out/latest-flipped"
file="$out/latest-flipped/checkpoints/step-00000010/rank-00001.safetensors" at=$(( $(stat -c %s "$file") / 2 ))
byte=$(od -An -tu1 -j "$at" -N1 "$file" | tr -d ' ')
printf "\\x$(printf %02x $((byte ^ 255)))" | dd of="$file" bs=1 seek="$at" conv=notrunc 2>/dev/null
expect_refused "resume = \"latest\" onto a damaged newest checkpoint" "step-00000010/rank-00001.safetensors" \
  "took .*step-00000010 as this run's newest checkpoint: move it away to resume from the one before it" -- \
  train "$out/latest-flipped" --set train.steps=12
# Going back to step 5 where the run saved step 10 would leave step 10 as "latest" and have
# rotation delete the new saves as the oldest: refused at start, naming both.
expect_refused "resume from step 5 beside the run's own step 10" "step-00000010 is a later checkpoint" "" -- \
  train "$out/checkpoint-mid-write" --set "checkpoint.resume=\"$good\""
# A token file rewritten in place since the checkpoint (its last token changed) is refused,
# naming it: the saved window index would name other tokens.
tokens="$out/tokens.tok" && cp data/licenses.tok "$tokens"
rewritten=(train tests/assets/fsdp-llama.toml --set "train.out_dir=\"$out/rewritten\"" --set "data.train=\"$tokens\"")
"$FSDPP" "${rewritten[@]}" --set train.steps=2 --set checkpoint.save_every=2 >"$out/rewritten.log" 2>&1 ||
  fail "rewritten data: the first run failed"
printf '\x0b' | dd of="$tokens" bs=1 seek=$(( $(stat -c %s "$tokens") - 2 )) conv=notrunc status=none
expect_refused "resume over a token file rewritten in place" "tokens.tok changed since the checkpoint" "" -- \
  "$FSDPP" "${rewritten[@]}" --set train.steps=4 --set 'checkpoint.resume="latest"'
# A token file with document ends is read by its documents: a position counted in windows of
# a stream does not carry over to it, and the refusal says so rather than naming a field.
# (A model of 300 tokens: byte-level documents add an end-of-document token to the 256 bytes.)
cp /usr/share/common-licenses/Apache-2.0 "$out/apache.txt" && cp /usr/share/common-licenses/GPL-3 "$out/gpl.txt"
"$PYTHON" scripts/prepare_data.py --out "$out/documents.tok" "$out/apache.txt" "$out/gpl.txt" >/dev/null ||
  fail "documents: prepare_data.py failed"
windows=(train tests/assets/fsdp-llama.toml --set 'model.path="tests/assets/models/tiny-qwen3"')
"$FSDPP" "${windows[@]}" --set "train.out_dir=\"$out/windows\"" --set train.steps=1 --set checkpoint.save_every=1 \
  >"$out/windows.log" 2>&1 || fail "documents: the run over windows failed"
expect_refused "resume from windows of a stream into a file of documents" "counts windows of a token stream" \
  "documents.tok gives rows of whole documents" -- \
  "$FSDPP" "${windows[@]}" --set "checkpoint.resume=\"$out/windows/checkpoints/step-00000001\"" \
  --set "train.out_dir=\"$out/documents\"" --set "data.train=\"$out/documents.tok\""
# A checkpoint resumes the model it saved: one of the same shapes that computes otherwise
# (another RoPE base and norm epsilon) is refused, naming each field.
other="$out/other-model" && mkdir -p "$other"
sed -e 's/"rope_theta": 10000.0/"rope_theta": 500000.0/' -e 's/"rms_norm_eps": 1e-06/"rms_norm_eps": 0.001/' \
  tests/assets/models/fsdp-llama/config.json >"$other/config.json"
expect_refused "resume into a model of the same shapes that computes otherwise" "step-00000005: saved another model" \
  "rms_norm_eps 1e-06 -> 0.001, rope_theta 10000.0 -> 500000.0" -- \
  "$FSDPP" train tests/assets/fsdp-llama.toml --set "train.out_dir=\"$other/run\"" --set "model.path=\"$other\"" \
  --set "checkpoint.resume=\"$good\""
# A disk with no room for one checkpoint is refused at start, on every rank, rather than
# failing at the first save after the steps before it. A small filesystem takes a mount,
# which a machine may not allow this process.
small="$out/small-disk" && mkdir -p "$small"
if mount -t tmpfs -o size=128k tmpfs "$small" 2>/dev/null; then
  expect_refused "a disk with no room for one checkpoint" "rank 0: .*small-disk/run/checkpoints" \
    "kB free on its filesystem, and a checkpoint of this run takes" -- \
    "$FSDPP" launch --nproc-per-node 2 -- train tests/assets/fsdp-llama.toml --set "train.out_dir=\"$small/run\""
  umount "$small"
else
  echo "skip a disk with no room for one checkpoint: no small filesystem can be mounted here"
fi
exit $status
