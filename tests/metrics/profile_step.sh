#!/usr/bin/env bash
# [metrics] profile_step = N traces step N into <out_dir>/profile-step-N-rank-R.json: a
# Chrome trace holding the step's operators (and, on a GPU, its kernels), which
# scripts/profile_summary.py reads. A negative step is refused naming the key.
set -euo pipefail
: "${FSDPP:?}" "${WORK:?}"
bash scripts/make_corpus.sh >/dev/null
out="$WORK/profile-step"
rm -rf "$out"
"$FSDPP" train examples/tiny-llama.toml --set train.steps=3 --set train.threads=1 --set metrics.profile_step=2 \
  --set "train.out_dir=\"$out\"" --set checkpoint.save_final=false --set metrics.progress=never
trace="$out/profile-step-2-rank-0.json"
python3 - "$trace" <<'PY'
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}
for op in ("aten::linear", "aten::scaled_dot_product_attention", "aten::_fused_adamw_"):
    assert op in ops, f"{op} missing from the trace of step 2 ({len(ops)} operators)"
print(f"profile: step 2 traced with {len(ops)} distinct operators, forward, backward and optimizer included")
PY
summary="$(python3 scripts/profile_summary.py "$trace")"
[[ "$summary" == *"no GPU activity recorded"* ]] || { echo "unexpected summary of a CPU trace: $summary" >&2; exit 1; }
if "$FSDPP" train examples/tiny-llama.toml --set metrics.profile_step=-1 2>"$out/err"; then
  echo "a negative profile_step was accepted" >&2; exit 1
else
  code=$?
fi
[ "$code" = 2 ] && grep -q "profile_step" "$out/err" || { echo "exit $code: $(cat "$out/err")" >&2; exit 1; }
echo "profile_step: a traced step, and a bad value refused with exit 2"
