#!/usr/bin/env bash
# Benchmark: policy evaluation plus plan validation for a model of over 1,000 modules
# (a 100-layer Llama built on the meta device, 64 simulated ranks), as `fsdpp plan` times it,
# against the 50 ms target. Runs each shipped text policy five times and prints the median;
# --smoke runs each once, which checks the script but times nothing worth keeping.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
fsdpp=${FSDPP:-build/fsdpp}
runs=5
while (($#)); do
  case $1 in
    --fsdpp) fsdpp=${2:?--fsdpp needs a path}; shift 2 ;;
    --smoke) runs=1; shift ;;
    *) echo "usage: $0 [--fsdpp PATH] [--smoke]" >&2; exit 2 ;;
  esac
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/model"
cat >"$work/model/config.json" <<JSON
{"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
 "num_hidden_layers": 100, "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": false}
JSON
for policy in llama transformer_auto size_based; do
  printf '[model]\npath = "%s"\n[data]\ntrain = "unused.tok"\n[policy]\nname = "%s"\n' "$work/model" "$policy" >"$work/run.toml"
  times=()
  for ((run = 0; run < runs; run++)); do
    line=$("$fsdpp" plan "$work/run.toml" --world 64 2>&1 >/dev/null | grep 'evaluated and validated in')
    times+=("$(sed -E 's/.* over ([0-9]+) modules .* in ([0-9.]+) ms/\2/' <<<"$line")")
    modules=$(sed -E 's/.* over ([0-9]+) modules .*/\1/' <<<"$line")
  done
  median=$(printf '%s\n' "${times[@]}" | sort -g | sed -n "$(((runs + 1) / 2))p")
  printf '%-17s %5d modules  median %8.2f ms  (runs: %s)  target 50 ms\n' "$policy" "$modules" "$median" "${times[*]}"
done
