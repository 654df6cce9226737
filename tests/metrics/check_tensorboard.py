"""TensorBoard event files hold what metrics.jsonl holds: a short run with evaluation writes
both, and TensorBoard's own reader (the `tensorboard` package) reads back, for every step, one
scalar per figure of the JSONL record, equal to it at float32 (the precision of a TensorBoard
scalar), and the evaluation's loss and perplexity at their steps. With a stated peak, each
step's MFU is its tokens/s times the FLOPs per token that scripts/bench_fsdp.py counts from
transformers' config and parameter count, over the peak."""
import json
import os
import shutil
import subprocess
import sys

import numpy
import transformers
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from bench_fsdp import flops_per_token  # noqa: E402

FSDPP = os.environ["FSDPP"]
WORK = os.path.join(os.environ["WORK"], "tensorboard")
MODEL, SEQ_LEN = "tests/assets/models/fsdp-llama", 32  # tests/assets/fsdp-llama.toml's
PEAK_TFLOPS = 0.5


def mfu_failures(records):
    """Steps whose MFU is not tokens/s x FLOPs per token / peak, counted independently."""
    config = transformers.AutoConfig.from_pretrained(MODEL)
    parameters = transformers.AutoModelForCausalLM.from_config(config).num_parameters()
    flops = flops_per_token(parameters, config, SEQ_LEN)
    steps = [r for r in records if "loss" in r]
    wrong = [r["step"] for r in steps
             if abs(r.get("mfu", 0) - r["tokens_per_s"] * flops / (PEAK_TFLOPS * 1e12)) > 1e-9 * r.get("mfu", 1)]
    print(f"{'ok  ' if not wrong else 'FAIL'} MFU of {len(steps)} steps from {flops:.4g} FLOPs per token "
          f"({parameters} parameters): steps {wrong} differ")
    return [f"MFU at steps {wrong}"] if wrong else []


def main():
    subprocess.run(["bash", "scripts/make_corpus.sh"], check=True, capture_output=True)
    shutil.rmtree(WORK, ignore_errors=True)
    subprocess.run([FSDPP, "train", "tests/assets/fsdp-llama.toml", "--set", f'train.out_dir="{WORK}"',
                    "--set", "train.steps=6", "--set", "train.eval_every=3", "--set", "data.eval_fraction=0.1",
                    "--set", "checkpoint.save_final=false", "--set", f"metrics.peak_tflops={PEAK_TFLOPS}"],
                   check=True, capture_output=True)
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
    failures += mfu_failures(records)
    for line in failures:
        print("FAIL", line)
    must_have = {"loss", "lr", "grad_norm", "tokens_per_s", "eta_s", "host_peak_gb", "mfu", "eval_loss",
                 "eval_perplexity"}
    print(f"{'ok  ' if not failures else 'FAIL'} {compared} scalars in {len(tags)} tags equal the JSONL records")
    if failures or not must_have <= tags:
        sys.exit(1)


if __name__ == "__main__":
    main()
