#!/usr/bin/env bash
# Runs one fuzz target for a bounded time: first over its committed seeds (valid files and
# every input that once broke a parser), then on mutations of them. New inputs that reach
# new code collect under WORK/<name>; a failing input is kept under WORK/artifacts and the
# command that replays it is printed.
# Usage: run_fuzzer.sh BINARY NAME SECONDS WORK
set -euo pipefail
binary=$1 name=$2 seconds=$3 work=$4
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$work/$name" "$work/artifacts"
# One input may take 10 s and 2 GiB at most: past that it is a hang or a runaway allocation.
if ! "$binary" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
     -dict="$here/dicts/$name.dict" -artifact_prefix="$work/artifacts/$name-" \
     "$work/$name" "$here/seeds/$name" 2>"$work/$name.log"; then
  tail -n 60 "$work/$name.log"
  echo "fuzz_$name failed; replay with: $binary $work/artifacts/$name-*" >&2
  exit 1
fi
grep -E '^stat::number_of_executed_units|^Done' "$work/$name.log" || true
