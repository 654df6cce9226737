"""TensorBoard event files hold what metrics.jsonl holds: a short run with evaluation writes
both, and TensorBoard's own reader (the `tensorboard` package) reads back, for every step, one
scalar per figure of the JSONL record, equal to it at float32 (the precision of a TensorBoard
scalar), and the evaluation's loss and perplexity at their steps; after a resume that redoes
steps, each step once, with the redone figures. With a stated peak, each
step's MFU is its tokens/s times the FLOPs per token that scripts/bench_fsdp.py counts from
transformers' config and parameter count, over the peak; a LoRA run's, with its frozen base
counted 4 FLOPs a weight."""
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


def lora_mfu_failures(out_dir):
    """A LoRA run's MFU: its frozen base counted 4 FLOPs a weight, its adapters 6, as
    flops_per_token counts them given the adapters' weights (peft's, of the same rank)."""
    from peft import LoraConfig, get_peft_model
    records = train(out_dir, "train.steps=2", "policy.options.lora_rank=4", f"metrics.peak_tflops={PEAK_TFLOPS}")
    config = transformers.AutoConfig.from_pretrained(MODEL)
    base = transformers.AutoModelForCausalLM.from_config(config)
    parameters = base.num_parameters()
    adapted = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    adapters = adapted.num_parameters() - parameters
    flops = flops_per_token(parameters + adapters, config, SEQ_LEN, frozen=parameters)
    full = flops_per_token(parameters + adapters, config, SEQ_LEN)
    wrong = [r["step"] for r in records if "loss" in r and
             abs(r["mfu"] - r["tokens_per_s"] * flops / (PEAK_TFLOPS * 1e12)) > 1e-9 * r["mfu"]]
    print(f"{'ok  ' if not wrong else 'FAIL'} LoRA MFU from {flops:.4g} FLOPs per token ({adapters} adapter weights "
          f"over {parameters} frozen; {full:.4g} were they all trained): steps {wrong} differ")
    return [f"LoRA MFU at steps {wrong}"] if wrong else []


def train(out_dir, *sets):
    subprocess.run([FSDPP, "train", "tests/assets/fsdp-llama.toml", "--set", f'train.out_dir="{out_dir}"',
                    "--set", "checkpoint.save_final=false"] + [a for s in sets for a in ("--set", s)],
                   check=True, capture_output=True)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def event_failures(out_dir, records):
    """(what differs between the TensorBoard scalars and the JSONL records, the scalars compared,
    the tags): each figure of a record at its step, once."""
    events = EventAccumulator(os.path.join(out_dir, "tensorboard"), size_guidance={"scalars": 0})
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
        steps = [e.step for e in events.Scalars(tag)]
        scalars = {e.step: e.value for e in events.Scalars(tag)}
        if steps != sorted(expected[tag]):
            failures.append(f"{tag}: steps {steps} != {sorted(expected[tag])}")
        for step, value in expected[tag].items():
            compared += 1
            if scalars.get(step) != numpy.float32(value):
                failures.append(f"{tag} at step {step}: {scalars.get(step)} != {numpy.float32(value)}")
    return failures, compared, tags


def main():
    subprocess.run(["bash", "scripts/make_corpus.sh"], check=True, capture_output=True)
    shutil.rmtree(WORK, ignore_errors=True)
    records = train(WORK, "train.steps=6", "train.eval_every=3", "data.eval_fraction=0.1",
                    f"metrics.peak_tflops={PEAK_TFLOPS}")
    failures, compared, tags = event_failures(WORK, records)
    failures += mfu_failures(records)
    failures += lora_mfu_failures(os.path.join(WORK, "lora"))
    # A run stopped after step 5 with a checkpoint at step 3 redoes steps 4 and 5 when it
    # resumes: TensorBoard shows each step once, the redone ones' figures, as the JSONL does.
    resumed = os.path.join(WORK, "resumed")
    train(resumed, "train.steps=5", "checkpoint.save_every=3")
    redone, redone_compared, _ = event_failures(
        resumed, train(resumed, "train.steps=6", "checkpoint.save_every=3", 'checkpoint.resume="latest"'))
    failures += [f"after a resume: {line}" for line in redone]
    for line in failures:
        print("FAIL", line)
    must_have = {"loss", "lr", "grad_norm", "tokens_per_s", "eta_s", "host_peak_gb", "mfu", "eval_loss",
                 "eval_perplexity"}
    print(f"{'ok  ' if not failures else 'FAIL'} {compared} scalars in {len(tags)} tags equal the JSONL records, "
          f"and {redone_compared} after a resume that redid two steps")
    if failures or not must_have <= tags:
        sys.exit(1)


if __name__ == "__main__":
    main()
