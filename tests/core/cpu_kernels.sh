#!/usr/bin/env bash
# Where a bf16 product faults (forced here with FSDPP_CPU_PROBE=fail, as on a CPU that
# advertises AMX without enabling it), the engine caps oneDNN below AMX, says so in one
# warning, and bf16 trains: one process, two launched ranks that inherit the answer, and a
# Python process importing the fsdpp package. `fsdpp probe` tells other programs the same
# cap. A cap set by the user is left alone.
set -euo pipefail
: "${FSDPP:?}" "${PYTHON:?}" "${WORK:?}"
unset ONEDNN_MAX_CPU_ISA FSDPP_CPU_KERNELS_CHECKED  # this test sets the cap itself
bash scripts/make_corpus.sh >/dev/null
out="$WORK/cpu-kernels"
rm -rf "$out"
mkdir -p "$out"
run=(train examples/tiny-llama.toml --set train.steps=3 --set train.threads=1 --set 'model.dtype="bfloat16"'
     --set checkpoint.save_final=false --set metrics.progress=never --set train.eval_every=0)

check() {  # NAME LOG: the run trained 3 steps and warned once
  local steps warnings
  steps=$(grep -c '"loss"' "$out/$1/metrics.jsonl")
  warnings=$(grep -c "oneDNN is capped at AVX512_CORE_BF16" "$2" || true)
  [ "$steps" = 3 ] && [ "$warnings" = 1 ] || { echo "FAIL $1: $steps steps, $warnings warnings" >&2; cat "$2" >&2; exit 1; }
  echo "ok   $1: a forced bf16 fault capped oneDNN with one warning, and bf16 trained 3 steps"
}

FSDPP_CPU_PROBE=fail "$FSDPP" "${run[@]}" --set "train.out_dir=\"$out/one\"" 2>"$out/one.log"
check one "$out/one.log"
FSDPP_CPU_PROBE=fail "$FSDPP" launch --nproc-per-node 2 -- "${run[@]}" --set "train.out_dir=\"$out/two\"" 2>"$out/two.log"
check two "$out/two.log"

[ "$(FSDPP_CPU_PROBE=fail "$FSDPP" probe)" = "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16" ] || { echo "FAIL: probe" >&2; exit 1; }
[ -z "$(FSDPP_CPU_PROBE=fail ONEDNN_MAX_CPU_ISA=AVX2 "$FSDPP" probe)" ] || { echo "FAIL: probe over a user's cap" >&2; exit 1; }
echo "ok   probe: prints the cap when needed, nothing over a cap the user set"

# The Python package settles the cap at import, in its own process (the C library's
# environment, which oneDNN reads), and a bf16 step runs.
FSDPP_CPU_PROBE=fail PYTHONPATH="$(dirname "$FSDPP")/python" OMP_NUM_THREADS=1 "$PYTHON" - "$out/py" >"$out/py.log" 2>&1 <<'PY' ||
import ctypes, sys
import torch
import fsdpp
cap = ctypes.CDLL(None).getenv
cap.restype = ctypes.c_char_p
assert cap(b"ONEDNN_MAX_CPU_ISA") == b"AVX512_CORE_BF16", cap(b"ONEDNN_MAX_CPU_ISA")
run = fsdpp.Run("examples/tiny-llama.toml", {"model.dtype": "bfloat16", "train.out_dir": sys.argv[1]})
ids = torch.randint(256, (2, 17))
torch.nn.functional.cross_entropy(run.model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
assert run.step()[1]
PY
  { echo "FAIL python: the package did not cap oneDNN or train in bf16" >&2; cat "$out/py.log" >&2; exit 1; }
[ "$(grep -c "oneDNN is capped at AVX512_CORE_BF16" "$out/py.log")" = 1 ] ||
  { echo "FAIL python: wanted one warning" >&2; cat "$out/py.log" >&2; exit 1; }
echo "ok   python: importing fsdpp capped oneDNN with one warning, and a bf16 step ran"
