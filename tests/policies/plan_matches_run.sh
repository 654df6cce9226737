#!/usr/bin/env bash
# `fsdpp plan --world 4` and a real 4-rank run of the same config must agree on the units
# and on each rank's parameter-shard bytes (the run reads them from its shard tensors).
set -uo pipefail
: "${FSDPP:?}" "${WORK:?}"
bash scripts/make_corpus.sh >/dev/null
out="$WORK/plan-vs-run"
rm -rf "$out" && mkdir -p "$out"
config=tests/assets/fsdp-llama.toml
"$FSDPP" plan $config --world 4 --json >"$out/plan.json" 2>/dev/null || { echo "FAIL: plan"; exit 1; }
"$FSDPP" launch --nproc-per-node 4 -- train $config --set train.steps=1 --set checkpoint.save_final=false \
  --set "train.out_dir=\"$out/run\"" >"$out/run.log" 2>&1 || { echo "FAIL: run"; tail "$out/run.log"; exit 1; }
python3 - "$out/plan.json" "$out/run.log" <<'PY'
import json, re, sys
plan = json.load(open(sys.argv[1]))
names = [u["name"] for u in plan["units"]]
want = plan["per_rank_bytes"]["params"]
seen = {}
for line in open(sys.argv[2]):
    m = re.match(r"\[rank (\d)\] .*sharded: (\d+) units \[(.*)\], parameter shards (\d+) bytes", line)
    if m:
        seen[int(m.group(1))] = (m.group(3).split(","), int(m.group(4)))
ok = sorted(seen) == [0, 1, 2, 3] and all(u == names and b == want for u, b in seen.values())
for rank, (units, got) in sorted(seen.items()):
    print(f"rank {rank}: {len(units)} units, {got} parameter-shard bytes; plan: {len(names)} units, {want} bytes")
print("plan and run agree" if ok else "FAIL: plan and run differ")
sys.exit(0 if ok else 1)
PY
