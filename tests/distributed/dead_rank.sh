#!/usr/bin/env bash
# A rank killed mid-run (SIGKILL) must not hang the job: `fsdpp launch` stops the other
# ranks and exits with status 2 and one line naming the rank and how it ended (the other
# ranks' lost connections are its consequences, not printed), within the configured
# timeout. Also checks that every line a rank prints carries its rank prefix. And a launcher
# killed mid-run (SIGKILL) leaves no rank behind: each is told to stop as by SIGTERM, saves
# its checkpoint and exits; a rank stopped by SIGSTOP is named as the one that stopped
# answering; a SIGINT sent to one rank alone is a stop, not a failure, and the job exits on
# that signal.
set -uo pipefail
: "${FSDPP:?}" "${WORK:?}"
bash scripts/make_corpus.sh >/dev/null
# The pid of rank 1 of the job `launcher` started, once its metrics file has logged step 3
# (up to 30 s); nothing if it never does.
rank_1_once_training() {
  local launcher=$1 metrics=$2 pid
  for _ in $(seq 1 300); do
    if grep -q '"step":3' "$metrics" 2>/dev/null; then
      for pid in $(pgrep -P "$launcher"); do
        if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx 'RANK=1'; then echo "$pid"; fi
      done
      return
    fi
    sleep 0.1
  done
}

out="$WORK/dead-rank"
rm -rf "$out" && mkdir -p "$out"
timeout_s=20
"$FSDPP" launch --nproc-per-node 3 -- train tests/assets/fsdp-llama.toml --set train.steps=100000 \
  --set train.log_every=1 --set "train.out_dir=\"$out/run\"" --set parallel.timeout_s=$timeout_s \
  >"$out/stdout" 2>"$out/stderr" &
launcher=$!
victim=$(rank_1_once_training $launcher "$out/run/metrics.jsonl")
ranks=($(pgrep -P $launcher))
if [ -z "$victim" ]; then
  echo "FAIL: rank 1 never started training"; kill $launcher; cat "$out/stderr"; exit 1
fi
start=$(date +%s%N)
kill -9 "$victim"
wait $launcher
rc=$?
elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))
echo "launcher exited with $rc, ${elapsed_ms} ms after rank 1 (pid $victim) was killed"
grep 'fsdpp' "$out/stderr" | grep -v '^\[rank' || true
status=0
[ "$rc" -eq 2 ] || { echo "FAIL: launcher exited $rc, not 2"; status=1; }
grep -q 'fsdpp: error: rank 1 failed with signal Killed' "$out/stderr" || { echo "FAIL: no line naming rank 1"; status=1; }
errors=$(grep -c 'fsdpp: \(internal \)\?error' "$out/stderr")
[ "$errors" -eq 1 ] || { echo "FAIL: $errors error lines, not one"; status=1; }
(( elapsed_ms < timeout_s * 1000 )) || { echo "FAIL: took longer than the ${timeout_s}s timeout"; status=1; }
if grep -v '^\[rank [0-2]\] ' "$out/stdout" | grep -q .; then echo "FAIL: unprefixed rank output"; status=1; fi
grep -q '^\[rank 0\] .*step 3/' "$out/stderr" || { echo "FAIL: rank 0 log lines lack their prefix"; status=1; }
# This job's own ranks alone: other tests may be training the same TOML beside this one.
left=()
for pid in "${ranks[@]}"; do  # a zombie left for init to reap is not running
  state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) && [ "$state" != Z ] && left+=("$pid")
done
if ((${#left[@]})); then echo "FAIL: ranks left running: ${left[*]}"; kill -9 "${left[@]}"; status=1; fi

"$FSDPP" launch --nproc-per-node 2 -- train tests/assets/fsdp-llama.toml --set train.steps=100000 \
  --set train.log_every=1 --set "train.out_dir=\"$out/orphans\"" >/dev/null 2>"$out/orphans.stderr" &
launcher=$!
ranks=()
for _ in $(seq 1 300); do
  if grep -q '"step":3' "$out/orphans/metrics.jsonl" 2>/dev/null; then ranks=($(pgrep -P $launcher)); break; fi
  sleep 0.1
done
kill -9 $launcher
wait $launcher 2>/dev/null
for _ in $(seq 1 300); do  # up to 30 s for the ranks to save and exit
  left=()
  for pid in "${ranks[@]}"; do
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) && [ "$state" != Z ] && left+=("$pid")
  done
  ((${#left[@]})) || break
  sleep 0.1
done
if ((${#ranks[@]} != 2)); then
  echo "FAIL: the second job's ranks never started training"; status=1
elif ((${#left[@]})); then
  echo "FAIL: ranks outlived their killed launcher: ${left[*]}"; kill -9 "${left[@]}"; status=1
elif ! ls "$out/orphans/checkpoints" 2>/dev/null | grep -q '^step-'; then
  echo "FAIL: the ranks of a killed launcher saved no checkpoint"; status=1
else
  echo "a killed launcher's ranks saved $(ls "$out/orphans/checkpoints") and exited"
fi

# Rank 1 stopped (SIGSTOP) mid-run, alive but silent: rank 0 gives up on its collective after
# [parallel] timeout_s, and the launcher's one line names rank 1 as the rank that stopped
# answering, not rank 0, whose failure is its consequence; the stopped rank is killed.
stall_timeout_s=10
"$FSDPP" launch --nproc-per-node 2 -- train tests/assets/fsdp-llama.toml --set train.steps=100000 \
  --set train.log_every=1 --set "train.out_dir=\"$out/stalled\"" --set parallel.timeout_s=$stall_timeout_s \
  >/dev/null 2>"$out/stalled.stderr" &
launcher=$!
victim=$(rank_1_once_training $launcher "$out/stalled/metrics.jsonl")
[ -n "$victim" ] || { echo "FAIL: the stalled job's rank 1 never started training"; kill -9 $launcher; exit 1; }
start=$(date +%s%N)
kill -STOP "$victim"
wait $launcher
rc=$?
elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))
said=$(grep 'fsdpp: \(internal \)\?error' "$out/stalled.stderr")
if [ "$rc" -ne 2 ] || [ "$(printf '%s\n' "$said" | grep -c .)" -ne 1 ] ||
   [[ "$said" != "fsdpp: error: rank 1 stopped answering: rank 0 gave up waiting ("*"timeout_s))" ]]; then
  echo "FAIL: a stopped rank 1 ended the launcher with $rc:"; printf '%s\n' "$said"; status=1
elif (( elapsed_ms > (stall_timeout_s + 20) * 1000 )); then
  echo "FAIL: a stopped rank took ${elapsed_ms} ms to report"; status=1
elif [ -e "/proc/$victim" ] && [ "$(awk '{print $3}' "/proc/$victim/stat" 2>/dev/null)" != Z ]; then
  echo "FAIL: the stopped rank 1 was left behind"; kill -9 "$victim"; status=1
else
  echo "a stopped rank 1 reported in ${elapsed_ms} ms: $said"
fi

# SIGINT sent to rank 1 alone, not the launcher: every rank stops at the same step and saves,
# each exits as that signal asks (rank 0, which caught none, too), and the launcher reports the
# stop (128 + SIGINT), not a failure.
"$FSDPP" launch --nproc-per-node 2 -- train tests/assets/fsdp-llama.toml --set train.steps=100000 \
  --set train.log_every=1 --set "train.out_dir=\"$out/one-signalled\"" >/dev/null 2>"$out/one-signalled.stderr" &
launcher=$!
victim=$(rank_1_once_training $launcher "$out/one-signalled/metrics.jsonl")
[ -n "$victim" ] || { echo "FAIL: the third job's rank 1 never started training"; kill -9 $launcher; exit 1; }
kill -INT "$victim"
wait $launcher
rc=$?
if [ "$rc" -ne 130 ] || grep -q 'fsdpp: error' "$out/one-signalled.stderr" ||
   ! grep -q '^\[rank 0\] .*stopped by Interrupt after step' "$out/one-signalled.stderr" ||
   ! grep -q '^fsdpp launch: every rank stopped after Interrupt' "$out/one-signalled.stderr"; then
  echo "FAIL: rank 1's SIGINT ended the launcher with $rc:"; grep -v ' info ' "$out/one-signalled.stderr"; status=1
elif ! ls "$out/one-signalled/checkpoints" 2>/dev/null | grep -q '^step-'; then
  echo "FAIL: rank 1's SIGINT saved no checkpoint"; status=1
else
  echo "rank 1's SIGINT: every rank saved $(ls "$out/one-signalled/checkpoints"), launcher exit 130"
fi
exit $status
