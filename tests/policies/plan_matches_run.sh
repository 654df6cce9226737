#!/usr/bin/env bash
# `fsdpp plan --world 4` and a real 4-rank run of the same config must agree on the units
# and on each rank's parameter-shard bytes (the run reads them from its shard tensors): for
# a full fine-tune, and for LoRA computing in bf16, whose frozen base is held in bf16 alone.
set -uo pipefail
: "${FSDPP:?}" "${WORK:?}"
bash scripts/make_corpus.sh >/dev/null
config=tests/assets/fsdp-llama.toml

# check NAME [--set KEY=VALUE ...]
check() {
  local name=$1 out="$WORK/plan-vs-run/$1"
  shift
  rm -rf "$out" && mkdir -p "$out"
  "$FSDPP" plan $config --world 4 --json "$@" >"$out/plan.json" 2>/dev/null || { echo "FAIL: $name: plan"; return 1; }
  "$FSDPP" launch --nproc-per-node 4 -- train $config --set train.steps=1 --set checkpoint.save_final=false \
    --set "train.out_dir=\"$out/run\"" "$@" >"$out/run.log" 2>&1 || { echo "FAIL: $name: run"; tail "$out/run.log"; return 1; }
  python3 - "$name" "$out/plan.json" "$out/run.log" <<'PY'
import json, re, sys
name = sys.argv[1]
plan = json.load(open(sys.argv[2]))
names = [u["name"] for u in plan["units"]]
want = plan["per_rank_bytes"]["params"]
constant = plan["per_rank_bytes"]["constant_params"]
seen = {}
for line in open(sys.argv[3]):
    m = re.match(r"\[rank (\d)\] .*sharded: (\d+) units \[(.*)\], parameter shards (\d+) bytes", line)
    if m:
        seen[int(m.group(1))] = (m.group(3).split(","), int(m.group(4)))
ok = sorted(seen) == [0, 1, 2, 3] and all(u == names and b == want for u, b in seen.values())
for rank, (units, got) in sorted(seen.items()):
    print(f"{name}: rank {rank}: {len(units)} units, {got} parameter-shard bytes; plan: {len(names)} units, "
          f"{want} bytes ({constant} of them frozen in bf16)")
if name == "lora-bf16":
    # Without masters the frozen base takes 2 bytes an element: about half the full fine-tune's shards.
    full = json.load(open(sys.argv[2].replace(name, "full")))["per_rank_bytes"]["params"]
    print(f"{name}: {want} parameter-shard bytes against the full fine-tune's {full} ({want / full:.2f}x)")
    ok &= constant > 0 and want < 0.6 * full
print(f"{name}: plan and run agree" if ok else f"FAIL: {name}: plan and run differ")
sys.exit(0 if ok else 1)
PY
}

failures=0
check full || failures=$((failures + 1))
check lora-bf16 --set policy.options.lora_rank=4 --set 'policy.options.param_dtype="bfloat16"' || failures=$((failures + 1))
exit $failures
