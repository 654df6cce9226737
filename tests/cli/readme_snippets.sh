#!/usr/bin/env bash
# The README's snippets as a reader copies them: its policy plans and takes its option, its
# Python steps a run, every run file it names exists and plans, and every dtype the README
# and docs spell is one the parser reads.
set -uo pipefail
: "${FSDPP:?}" "${PYTHON:?}" "${WORK:?}"
work="$WORK/readme"
rm -rf "$work" && mkdir -p "$work"
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }

# The ```lua block: a whole policy, with its declared option set.
awk '/^```lua$/ {inside = 1; next} /^```$/ {inside = 0} inside' README.md >"$work/my_policy.lua"
[ -s "$work/my_policy.lua" ] || fail "README.md has no lua block"
if "$FSDPP" plan examples/tiny-llama.toml --world 4 --set "policy.name=\"$work/my_policy.lua\"" \
    --set policy.options.recompute=true >"$work/plan.txt" 2>"$work/plan.err"; then
  grep -q "activation_checkpoint true" "$work/plan.txt" || fail "the README policy ignores recompute = true"
  grep -q '^  \* recompute = true' "$work/plan.txt" || fail "fsdpp plan does not list the README policy's option"
else
  fail "the README policy does not plan: $(tail -1 "$work/plan.err")"
fi

# The ```python block: the fsdpp package driving a step of the default example.
awk '/^```python$/ {inside = 1; next} /^```$/ {inside = 0} inside' README.md >"$work/readme.py"
printf 'assert stepped and grad_norm > 0, (grad_norm, stepped)\n' >>"$work/readme.py"
PYTHONPATH="$(dirname "$FSDPP")/python" OMP_NUM_THREADS=1 "$PYTHON" "$work/readme.py" >"$work/py.txt" 2>&1 ||
  fail "the README's Python does not run: $(tail -1 "$work/py.txt")"

# Every examples/*.toml the README names plans as it stands. The chat examples' model is made
# by scripts/make_sft_example.py, as scripts/sft_example.sh makes it on a fresh machine.
for toml in $(grep -oE 'examples/[a-z0-9_-]+\.toml' README.md | sort -u); do
  model_set=()
  if grep -q '^path = "data/sft/model"' "$toml"; then
    [ -d "$work/sft/model" ] || "$PYTHON" scripts/make_sft_example.py "$work/sft" >/dev/null 2>&1 ||
      fail "scripts/make_sft_example.py does not make the chat examples' model"
    model_set=(--set "model.path=\"$work/sft/model\"")
  fi
  "$FSDPP" plan "$toml" --world 2 "${model_set[@]}" >/dev/null 2>"$work/err.txt" ||
    fail "$toml: $(tail -1 "$work/err.txt")"
done

# Every quoted word of the README, docs/ and examples/ that names a floating-point dtype
# (compute = "fp8" names a kind of product, not a dtype).
for dtype in $(grep -ohE '(compute = )?"(float|bfloat|fp|bf|half|double)[0-9]*"' README.md docs/*.md examples/*.toml \
                 examples/*.lua | grep -v '^compute' | tr -d '"' | sort -u); do
  "$FSDPP" plan examples/tiny-llama.toml --world 1 --set "policy.options.param_dtype=\"$dtype\"" >/dev/null 2>&1 ||
    fail "dtype '$dtype' written in the docs is not one the parser reads"
done

[ $failures -eq 0 ] && echo "ok   README snippets" || exit 1
