#!/usr/bin/env bash
# Golden plans: every shipped policy against every model it targets (tiny configs), printed
# by `fsdpp plan --world 4` and compared with tests/assets/plans/. After a deliberate change,
# regenerate with: FSDPP=build/fsdpp bash tests/policies/golden_plans.sh --update
set -uo pipefail
: "${FSDPP:?}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
update=0; [ "${1:-}" = "--update" ] && update=1
failures=0

# NAME POLICY MODEL_DIR [--set KEY=VALUE ...]
golden() {
  local name=$1 policy=$2 model=$3; shift 3
  cat >"$work/$name.toml" <<TOML
[model]
path = "$model"
[data]
train = "unused.tok"
[policy]
name = "$policy"
TOML
  local want="tests/assets/plans/$name.txt"
  if ! "$FSDPP" plan "$work/$name.toml" --world 4 "$@" >"$work/$name.txt" 2>"$work/$name.err"; then
    echo "FAIL $name: fsdpp plan failed:"; cat "$work/$name.err"; failures=$((failures + 1)); return
  fi
  if [ $update -eq 1 ]; then
    cp "$work/$name.txt" "$want"; echo "updated $want"
  elif diff -u "$want" "$work/$name.txt"; then
    echo "ok   $name"
  else
    echo "FAIL $name differs from $want"; failures=$((failures + 1))
  fi
}

golden llama-untied llama tests/assets/models/fsdp-llama
golden llama-tied llama examples/models/tiny-llama
golden llama-tied-fused-bf16 llama examples/models/tiny-llama --set 'model.dtype="bfloat16"' \
  --set policy.options.fused_linear_logprob=true --set policy.options.shard_size=2 \
  --set policy.options.activation_checkpoint=true --set policy.options.reshard_after_forward=false
golden qwen2 qwen2 tests/assets/models/tiny-qwen2
golden llama-untied-reshard-2 llama tests/assets/models/fsdp-llama --set policy.options.reshard_after_forward=2
golden qwen3 qwen3 tests/assets/models/tiny-qwen3
golden mistral mistral tests/assets/models/tiny-mistral
golden qwen2-unit-bf16 qwen2 tests/assets/models/tiny-qwen2 --set 'policy.options.param_dtype="bf16"'
golden llama-fp8 llama tests/assets/models/fsdp-llama --set 'policy.options.param_dtype="bf16"' --set 'policy.options.compute="fp8"'
golden qwen3-hsdp-offload qwen3 tests/assets/models/tiny-qwen3 --set policy.options.replicate=2 \
  --set 'policy.options.offload="cpu"'
golden transformer_auto-qwen3-mlp transformer_auto tests/assets/models/tiny-qwen3 \
  --set 'policy.options.classes="Qwen3MLP"'
golden size_based-llama size_based tests/assets/models/fsdp-llama --set policy.options.min_num_params=5000
golden qwen3_moe qwen3_moe tests/assets/models/fsdp-qwen3-moe
golden qwen3_moe-expert-units qwen3_moe tests/assets/models/fsdp-qwen3-moe --set 'policy.options.experts="unit"' \
  --set policy.options.experts_reshard_after_forward=2 --set 'policy.options.experts_param_dtype="bf16"'
golden transformer_auto-qwen3_moe-expert-units transformer_auto tests/assets/models/fsdp-qwen3-moe \
  --set 'policy.options.experts="unit"'
golden deepseek_v3 deepseek_v3 tests/assets/models/fsdp-deepseek-v3
golden deepseek_v3-expert-units deepseek_v3 tests/assets/models/fsdp-deepseek-v3 \
  --set 'policy.options.experts="unit"' --set 'policy.options.experts_offload="cpu"'
golden transformer_auto-deepseek_v3 transformer_auto tests/assets/models/fsdp-deepseek-v3
# In bf16 the routers, which transformers keeps in float32, gather in float32 in units of their own.
golden deepseek_v3-bf16 deepseek_v3 tests/assets/models/fsdp-deepseek-v3 --set 'policy.options.param_dtype="bf16"'
golden llama-lora llama tests/assets/models/fsdp-llama --set policy.options.lora_rank=4 \
  --set 'policy.options.lora_targets="q_proj,v_proj,down_proj"' --set 'policy.options.lora_trainable="model.norm"'
golden llama-lora-bf16 llama tests/assets/models/fsdp-llama --set policy.options.lora_rank=4 \
  --set 'policy.options.lora_targets="q_proj,v_proj,down_proj"' --set 'policy.options.param_dtype="bf16"'
golden qwen2_vl-shard qwen2_vl tests/assets/models/tiny-qwen2-vl
golden qwen2_vl-root qwen2_vl tests/assets/models/tiny-qwen2-vl --set policy.options.mixed_mm_data=true
golden qwen2_5_vl-shard qwen2_5_vl tests/assets/models/tiny-qwen2_5-vl
golden qwen2_5_vl-replicate qwen2_5_vl tests/assets/models/tiny-qwen2_5-vl --set 'policy.options.vision_tower="replicate"'

# The JSON plan's routed-expert bytes: per rank, the fp32 master shards, adding up to the
# per-rank total; gathered, 2 bytes an element in the units' bf16.
"$FSDPP" plan "$work/qwen3_moe-expert-units.toml" --world 4 --json --set 'policy.options.experts="unit"' \
  --set 'policy.options.experts_param_dtype="bf16"' >"$work/experts.json" 2>/dev/null
python3 - "$work/experts.json" <<'PY' || failures=$((failures + 1))
import json, sys
plan = json.load(open(sys.argv[1]))
units = [u for u in plan["units"] if u["expert_numel"] > 0]
ok = len(units) == 2 and sum(u["expert_bytes_per_rank"] for u in units) == plan["per_rank_bytes"]["expert_params"] \
    and all(u["expert_bytes_per_rank"] == 4 * u["expert_numel_per_rank"]
            and u["expert_bytes_gathered"] == 2 * u["expert_numel"] for u in units)
print(f"{'ok  ' if ok else 'FAIL'} expert bytes of the JSON plan: {[(u['expert_bytes_per_rank'], u['expert_bytes_gathered']) for u in units]}, "
      f"per rank {plan['per_rank_bytes']['expert_params']}")
sys.exit(0 if ok else 1)
PY

# Options given to no purpose are said: experts_* beside experts = "layer", a vision tower's
# options on a text model, vision_tower over mixed_mm_data, a LoRA rank that is not low.
unused() {  # NAME TOML WARNING [--set ...]
  local name=$1 toml=$2 warning=$3; shift 3
  if "$FSDPP" plan "$toml" --world 4 "$@" >/dev/null 2>"$work/unused.err" && grep -qF "$warning" "$work/unused.err"; then
    echo "ok   $name: $warning"
  else
    echo "FAIL $name: no '$warning' in: $(tail -2 "$work/unused.err")"; failures=$((failures + 1))
  fi
}
unused "experts_offload beside experts = layer" "$work/qwen3_moe-expert-units.toml" \
  'experts_offload: applies with experts = "unit" alone, and experts is "layer"' --set 'policy.options.experts_offload="cpu"'
unused "vision_tower on a text model" "$work/llama-untied.toml" "vision_tower: this model has no vision tower" \
  --set 'policy.options.vision_tower="root"'
unused "vision_tower over mixed_mm_data" "$work/qwen2_vl-shard.toml" \
  'mixed_mm_data = true asks vision_tower = "root"; vision_tower = "shard" overrides it' \
  --set policy.options.mixed_mm_data=true --set 'policy.options.vision_tower="shard"'
unused "LoRA rank at a target's smaller side" "$work/llama-untied.toml" \
  'lora: rank 10 is not below the smaller side of 6 of the 12 targets (model.layers.0.self_attn.k_proj [10, 30], ...)' \
  --set policy.options.lora_rank=10 --set 'policy.options.lora_targets="q_proj,k_proj,v_proj,o_proj"'

# A freeze that would train what it was to hold, or hold everything, is refused in one line.
refused() {  # NAME TOML ERROR [--set ...]
  local name=$1 toml=$2 error=$3; shift 3
  "$FSDPP" plan "$toml" --world 4 "$@" >/dev/null 2>"$work/refused.err"
  local status=$?
  if [ $status -eq 2 ] && [ "$(wc -l <"$work/refused.err")" -eq 1 ] && grep -qF "$error" "$work/refused.err"; then
    echo "ok   $name: $(cat "$work/refused.err")"
  else
    echo "FAIL $name: exit $status, wanted 2 and one line with '$error': $(tail -2 "$work/refused.err")"
    failures=$((failures + 1))
  fi
}
refused "freeze of a misspelt module" "$work/qwen2_vl-shard.toml" "freeze: 'visaul' matches no module" \
  --set 'policy.options.freeze="visaul"'
refused "a LoRA option without lora_rank" "$work/llama-untied.toml" \
  "lora_alpha is given without lora_rank, so no adapter would be made and the whole model would train" \
  --set policy.options.lora_alpha=16
refused "freeze of every parameter" "$work/llama-untied.toml" "freeze holds every parameter of the model" \
  --set 'policy.options.freeze="model,lm_head"'

# Freezing a tied lm_head holds the embedding it is, and the plan says so.
"$FSDPP" plan "$work/llama-tied.toml" --world 4 --set 'policy.options.freeze="lm_head"' >/dev/null 2>"$work/tied.err"
if grep -qF "freeze: model.embed_tokens.weight is lm_head.weight (tied), so it stays as loaded too" "$work/tied.err"; then
  echo "ok   freeze of a tied lm_head names the embedding it holds"
else
  echo "FAIL freeze of a tied lm_head: $(tail -2 "$work/tied.err")"; failures=$((failures + 1))
fi

[ $failures -eq 0 ] || { echo "$failures golden plan(s) differ"; exit 1; }
