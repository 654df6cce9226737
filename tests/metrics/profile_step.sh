#!/usr/bin/env bash
# [metrics] profile_step = N traces step N into <out_dir>/profile-step-N-rank-R.json: a
# Chrome trace holding the step's operators (and, on a GPU, its kernels), which
# scripts/profile_summary.py reads; count_step = N counts its kernels and bytes into
# <out_dir>/ops-step-N-rank-R.json. A negative step is refused naming the key.
set -euo pipefail
: "${FSDPP:?}" "${WORK:?}"
mkdir -p "$WORK"
bash scripts/make_corpus.sh >/dev/null
out="$WORK/profile-step"
rm -rf "$out"
"$FSDPP" train examples/tiny-llama.toml --set train.steps=3 --set train.threads=1 --set metrics.profile_step=2 \
  --set "train.out_dir=\"$out\"" --set checkpoint.save_final=false --set metrics.progress=never 2>"$out.log" ||
  { cat "$out.log" >&2; exit 1; }
# Without a GPU the profiler keeps its failed device query to itself: the run prints its log alone.
if grep -qv ' info ' "$out.log"; then echo "the traced run printed: $(grep -v ' info ' "$out.log")" >&2; exit 1; fi
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
# A GPU trace's kernels by kind, as ATen and the engine name them: the gradient norm's
# _foreach_norm kernels are no normalisation, a scatter no concatenation.
python3 - <<'PY' || exit 1
import sys
sys.path.insert(0, "scripts")
from profile_summary import kind_of
for name, kind in [("multi_tensor_apply_kernel<TensorListMetadata<1>, LpNormFunctor<float, 2>, float*>", "gradient norm"),
                   ("lpnorm_cleanup<float, 2, float, float>", "gradient norm"),
                   ("add_rms_norm_forward_kernel", "normalisation"),
                   ("_scatter_gather_elementwise_kernel<128, 4>", "other elementwise, reductions"),
                   ("CatArrayBatchedCopy<float, unsigned int, 2, 128, 1>", "copies, casts, fills"),
                   ("fused_adamw_kernel", "optimizer")]:
    assert kind_of(name) == kind, f"{name}: {kind_of(name)}, not {kind}"
PY
if "$FSDPP" train examples/tiny-llama.toml --set metrics.profile_step=-1 2>"$out/err"; then
  echo "a negative profile_step was accepted" >&2; exit 1
else
  code=$?
fi
[ "$code" = 2 ] && grep -q "profile_step" "$out/err" || { echo "exit $code: $(cat "$out/err")" >&2; exit 1; }
# [metrics] count_step = N counts step N's kernels on every rank (engine/metrics/op_count.h).
count="$WORK/count-step"
rm -rf "$count"
"$FSDPP" launch --nproc-per-node 2 -- train examples/tiny-llama.toml --set train.steps=3 --set train.threads=1 \
  --set metrics.count_step=2 --set "train.out_dir=\"$count\"" --set checkpoint.save_final=false \
  --set metrics.progress=never 2>"$count.log"
grep -q "ops: step 2 launched [0-9]* kernels" "$count.log" || { cat "$count.log" >&2; exit 1; }
python3 - "$count" <<'PY'
import json, sys
for rank in (0, 1):
    c = json.load(open(f"{sys.argv[1]}/ops-step-2-rank-{rank}.json"))
    ops = c["ops"]
    # The step's products, attention both ways, AdamW and the reduce-scatter's copy-in.
    for op in ("aten::mm", "aten::_fused_adamw_", "aten::_chunk_cat"):
        assert op in ops, f"rank {rank}: {op} missing from the count of step 2"
    assert c["matmul_kernels"] == sum(ops[o]["calls"] for o in ops if o in ("aten::mm", "aten::addmm"))
    assert c["attention_kernels"] == 8, c["attention_kernels"]  # 4 layers, forward and backward
    assert c["kernels"] == sum(v["calls"] for v in ops.values())
    assert c["other_kernels"] == c["kernels"] - c["matmul_kernels"] - c["attention_kernels"]
    assert not any(o.startswith("c10d::") or o in ("aten::view", "aten::empty", "aten::linear") for o in ops)
print(f"count_step: step 2 counted on both ranks, {c['kernels']} kernels on rank 1")
PY
# A group of one copies nothing around its collectives: in float32 the parameters view their
# masters, and each gradient becomes its shard's as it is.
"$FSDPP" train examples/tiny-llama.toml --set train.steps=2 --set train.threads=1 --set metrics.count_step=2 \
  --set "train.out_dir=\"$count/one\"" --set checkpoint.save_final=false --set metrics.progress=never 2>/dev/null
python3 - "$count/one/ops-step-2-rank-0.json" "$count/ops-step-2-rank-0.json" <<'PY'
import json, sys
one, two = (json.load(open(path)) for path in sys.argv[1:])
ops = one["ops"]
copies = {o: ops[o] for o in ("aten::_chunk_cat", "aten::copy_") if o in ops}
assert not copies, f"a world of one copied around its collectives: {copies}"
# The tied embedding's backward adds its rows into lm_head's gradient: no [V, C] of its own.
dense = [o for o in ops if "embedding_dense_backward" in o or o == "aten::embedding_backward"]
assert not dense, f"the embedding's backward wrote a dense gradient: {dense}"
# The tiny model's rows split evenly over 2 ranks, so no padding separates q, k and v in the
# unit's gathered buffer: they run as one product at world 2 as at world 1.
assert two["matmul_kernels"] == one["matmul_kernels"], (two["matmul_kernels"], one["matmul_kernels"])
print("count_step: a world of one in float32 copies no parameter or gradient; "
      f"{one['matmul_kernels']} matrix products at worlds 1 and 2")
PY
# A MoE layer's experts in one unit at world 2 lie one stride apart in its gathered buffer:
# their grouped products read them in place, with no stack of their weights either way.
moe=tests/assets/models/fsdp-qwen3-moe-grouped
"$FSDPP" launch --nproc-per-node 2 -- train tests/assets/fsdp-llama.toml --set "model.path=\"$moe\"" \
  --set data.seq_len=8 --set 'policy.options.param_dtype="float32"' --set 'policy.options.experts="unit"' \
  --set train.steps=2 --set train.threads=1 --set metrics.count_step=2 --set "train.out_dir=\"$count/moe\"" \
  --set checkpoint.save_final=false --set metrics.progress=never 2>"$count/moe.log" || { cat "$count/moe.log" >&2; exit 1; }
python3 - "$count/moe/ops-step-2-rank-0.json" "$moe/config.json" <<'PY'
import json, sys
ops = json.load(open(sys.argv[1]))["ops"]
config = json.load(open(sys.argv[2]))
assert ops.get("aten::_grouped_mm", {}).get("calls", 0) > 0, "the experts did not run grouped"
# One projection of every expert stacked would move its weights twice (read and written).
one_stack = 2 * config["num_experts"] * config["moe_intermediate_size"] * config["hidden_size"] * 4
stacked = ops.get("aten::stack", {}).get("bytes", 0)
assert stacked < one_stack, f"{stacked} bytes stacked, where one stack of an expert projection is {one_stack}"
print(f"count_step: grouped experts at world 2 read in place ({stacked} bytes stacked in all)")
PY
if "$FSDPP" train examples/tiny-llama.toml --set metrics.count_step=-1 2>"$count/err"; then
  echo "a negative count_step was accepted" >&2; exit 1
else
  code=$?
fi
[ "$code" = 2 ] && grep -q "count_step" "$count/err" || { echo "exit $code: $(cat "$count/err")" >&2; exit 1; }
echo "profile_step and count_step: a traced step, a counted one, and bad values refused with exit 2"
