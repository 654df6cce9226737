#!/usr/bin/env bash
# The multimodal example end to end: pictures drawn, patches cut by the HF image processor
# (scripts/make_multimodal_example.py), then 20 steps at world 2 in each vision-tower mode.
# Each run must finish with its loss well below where it started (ln 300 ≈ 5.7 at random);
# a sample whose placeholders do not match its grids is refused naming the file and line.
set -uo pipefail
: "${FSDPP:?}" "${PYTHON:?}" "${WORK:?}"
out="$WORK/multimodal-example"
rm -rf "$out" && mkdir -p "$out"
"$PYTHON" scripts/make_multimodal_example.py >"$out/make.log" 2>&1 || { cat "$out/make.log"; exit 1; }
status=0
for mode in shard root replicate; do
  "$FSDPP" launch --nproc-per-node 2 -- train examples/tiny-qwen2-vl.toml --set train.steps=20 \
    --set "train.out_dir=\"$out/$mode\"" --set checkpoint.save_final=false \
    --set "policy.options.vision_tower=\"$mode\"" >"$out/$mode.log" 2>&1
  rc=$?
  first=$(head -1 "$out/$mode/metrics.jsonl" | sed 's/.*"loss":\([0-9.]*\).*/\1/')
  last=$(tail -1 "$out/$mode/metrics.jsonl" | sed 's/.*"loss":\([0-9.]*\).*/\1/')
  if [ "$rc" -eq 0 ] && awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 1.0) }'; then
    echo "ok   vision_tower $mode: loss $first -> $last in 20 steps"
  else
    echo "FAIL vision_tower $mode: exit $rc, loss $first -> $last"; tail -5 "$out/$mode.log"; status=1
  fi
done
bad="$out/bad-dataset"
cp -r data/multimodal-example/dataset "$bad"
sed -i '3s/290, 290, /290, /' "$bad/samples.jsonl"  # one image placeholder fewer on line 3
"$FSDPP" train examples/tiny-qwen2-vl.toml --set "data.train=\"$bad\"" --set "train.out_dir=\"$out/bad\"" \
  >"$out/bad.log" 2>&1
rc=$?
if [ "$rc" -eq 2 ] && grep -q '^fsdpp: error: .*samples.jsonl:3: .*placeholders' "$out/bad.log"; then
  echo "ok   bad sample: $(grep '^fsdpp: error' "$out/bad.log")"
else
  echo "FAIL bad sample: exit $rc"; tail -3 "$out/bad.log"; status=1
fi
exit $status
