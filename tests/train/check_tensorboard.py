"""TensorBoard event files hold what metrics.jsonl holds: a short run with evaluation writes
both, and TensorBoard's own reader (the `tensorboard` package) reads back, for every step, one
scalar per figure of the JSONL record, equal to it at float32 (the precision of a TensorBoard
scalar), and the evaluation's loss and perplexity at their steps."""
import json
import os
import shutil
import subprocess
import sys

import numpy
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

FSDPP = os.environ["FSDPP"]
WORK = os.path.join(os.environ["WORK"], "tensorboard")


def main():
    subprocess.run(["bash", "scripts/make_corpus.sh"], check=True, capture_output=True)
    shutil.rmtree(WORK, ignore_errors=True)
    subprocess.run([FSDPP, "train", "tests/assets/fsdp-llama.toml", "--set", f'train.out_dir="{WORK}"',
                    "--set", "train.steps=6", "--set", "train.eval_every=3", "--set", "data.eval_fraction=0.1",
                    "--set", "checkpoint.save_final=false"], check=True, capture_output=True)
    with open(os.path.join(WORK, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    events = EventAccumulator(os.path.join(WORK, "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected, compared, failures = {}, 0, []
    for record in records:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                expected.setdefault(key, {})[record["step"]] = value
    if tags != set(expected):
        failures.append(f"tags {sorted(tags)} != JSONL keys {sorted(expected)}")
    for tag in tags & set(expected):
        scalars = {e.step: e.value for e in events.Scalars(tag)}
        if scalars.keys() != expected[tag].keys():
            failures.append(f"{tag}: steps {sorted(scalars)} != {sorted(expected[tag])}")
        for step, value in expected[tag].items():
            compared += 1
            if scalars.get(step) != numpy.float32(value):
                failures.append(f"{tag} at step {step}: {scalars.get(step)} != {numpy.float32(value)}")
    for line in failures:
        print("FAIL", line)
    must_have = {"loss", "lr", "grad_norm", "tokens_per_s", "eta_s", "host_peak_gb", "eval_loss", "eval_perplexity"}
    print(f"{'ok  ' if not failures else 'FAIL'} {compared} scalars in {len(tags)} tags equal the JSONL records")
    if failures or not must_have <= tags:
        sys.exit(1)


if __name__ == "__main__":
    main()
