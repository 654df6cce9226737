"""A run saved at world 2 and resumed must continue as if never interrupted. One world-2 run
of tests/assets/fsdp-llama.toml trains 10 steps, saving at step 5; resuming that checkpoint
at world 2 must give bitwise the same losses and final weights, and at world 1, 3 and 2x2
HSDP (the shards re-cut for each) the same within compare.FLOAT64_BOUND (the runs are
float64; only reduction orders differ); a Qwen3-MoE model, and a DeepSeek-V3 one whose
routing biases move after every step, saved at world 2 resume at 3 alike. Also: "latest"
picks the newest checkpoint, rotation keeps `keep` of them, the metrics file of a resumed run
holds each step once, and a data stream the saved position cannot carry over to (another
seq_len) is refused with the reason."""
import json
import os
import shutil
import subprocess
import sys

from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from compare import FLOAT64_BOUND, max_relative, weight_difference  # noqa: E402

FSDPP = os.environ["FSDPP"]
WORK = os.path.join(os.environ["WORK"], "resume")
CONFIG = "tests/assets/fsdp-llama.toml"


def train(out_dir, world, sets, expect_rc=0):
    args = ["train", CONFIG, "--set", f'train.out_dir="{out_dir}"', "--set", 'model.dtype="float64"'] + \
        [a for s in sets for a in ("--set", s)]
    cmd = [FSDPP] + args if world == 0 else [FSDPP, "launch", "--nproc-per-node", str(world), "--"] + args
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != expect_rc:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {proc.returncode}, expected {expect_rc}:\n{proc.stderr[-3000:]}")
    return proc


def losses(out_dir):
    records = [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl")) if '"loss"' in l]
    return {r["step"]: r["loss"] for r in records}, [r["step"] for r in records]


def weights(out_dir):
    return load_file(os.path.join(out_dir, "model", "model.safetensors"))


def compare(name, out_dir, ref_dir, tolerance):
    got, _ = losses(out_dir)
    ref, _ = losses(ref_dir)
    steps = list(range(6, 11))
    if sorted(got) != list(range(1, 11)) and sorted(got) != steps:
        return print(f"FAIL {name}: steps {sorted(got)}") or False
    loss_err = max_relative([got[s] for s in steps], [ref[s] for s in steps])
    w, w_ref = weights(out_dir), weights(ref_dir)
    weight_err, _ = weight_difference(w, w_ref)
    ok = w.keys() == w_ref.keys() and loss_err <= tolerance and weight_err <= tolerance
    print(f"{'ok  ' if ok else 'FAIL'} {name}: steps 6-10 max relative loss difference {loss_err:.2e}, "
          f"final weights {weight_err:.2e} (allowed {tolerance:g})")
    return ok


def main():
    subprocess.run(["bash", "scripts/make_corpus.sh"], check=True, capture_output=True)
    shutil.rmtree(WORK, ignore_errors=True)
    ref = os.path.join(WORK, "uninterrupted")
    train(ref, 2, ["checkpoint.save_every=5", "checkpoint.keep=0"])
    saved = os.path.join(ref, "checkpoints", "step-00000005")
    ok = os.path.isfile(os.path.join(saved, "metadata.json"))
    cases = [("world 2 -> 2", 2, [], 0.0), ("world 2 -> 1", 0, [], FLOAT64_BOUND), ("world 2 -> 3", 3, [], FLOAT64_BOUND),
             ("world 2 -> 2x2 HSDP", 4, ["policy.options.replicate=2"], FLOAT64_BOUND)]
    for name, world, sets, tolerance in cases:
        out = os.path.join(WORK, name.replace(" ", "").replace(">", ""))
        train(out, world, sets + [f'checkpoint.resume="{saved}"'])
        ok &= compare(name, out, ref, tolerance)

    # MoE models (a few hundred tensors, experts that get no token on some rank) saved at
    # world 2 resume at world 3 with their shards re-cut; DeepSeek-V3's routing biases, moved
    # by the step's counts, are among the weights compared.
    for family, extra in (("qwen3-moe", []), ("deepseek-v3", ["experts.bias_update_rate=0.01"])):
        moe = [f'model.path="tests/assets/models/fsdp-{family}"', "data.seq_len=8"] + extra
        moe_ref = os.path.join(WORK, f"{family}-uninterrupted")
        train(moe_ref, 2, moe + ["checkpoint.save_every=5", "checkpoint.keep=0"])
        moe_saved = os.path.join(moe_ref, "checkpoints", "step-00000005")
        out = os.path.join(WORK, f"{family}-2-3")
        train(out, 3, moe + [f'checkpoint.resume="{moe_saved}"'])
        ok &= compare(f"{family} world 2 -> 3", out, moe_ref, FLOAT64_BOUND)

    # Resuming into the same directory with "latest": a run that ended after step 7 (with
    # checkpoints at 3 and 6, keep = 2) continues from step 6 and records each step once. A
    # constant schedule makes its first 7 steps those of a 10-step run.
    constant = ['scheduler.kind="constant"']
    constant_ref = os.path.join(WORK, "constant")
    train(constant_ref, 2, constant)
    latest = os.path.join(WORK, "latest")
    common = constant + ["checkpoint.save_every=3", "checkpoint.keep=2", 'checkpoint.resume="latest"']
    train(latest, 2, common + ["train.steps=7", "checkpoint.save_final=false"])
    first = sorted(os.listdir(os.path.join(latest, "checkpoints")))
    proc = train(latest, 2, common)
    kept = sorted(os.listdir(os.path.join(latest, "checkpoints")))
    _, steps = losses(latest)
    rotation_ok = first == ["step-00000003", "step-00000006"] and kept == ["step-00000009", "step-00000010"] \
        and "continuing after step 6" in proc.stderr and steps == list(range(1, 11))
    print(f"{'ok  ' if rotation_ok else 'FAIL'} latest + rotation: after the first run {first}, after the "
          f"second {kept}; metrics steps {steps}")
    ok &= rotation_ok and compare("latest at world 2", latest, constant_ref, 0.0)

    # A resume at another batch size counts the tokens on from the saved count, each step at
    # the batch it had: steps 1-5 at the saved run's, 6-10 at half of it, in metrics.jsonl and
    # in the final checkpoint.
    halved = os.path.join(WORK, "halved")
    train(halved, 0, [f'checkpoint.resume="{saved}"', "data.batch_size=6"])
    tokens = {r["step"]: r["tokens"] for r in map(json.loads, open(os.path.join(halved, "metrics.jsonl")))
              if "tokens" in r}
    batch = {r["step"]: r["tokens"] for r in map(json.loads, open(os.path.join(ref, "metrics.jsonl")))
             if "tokens" in r}[1]
    final = json.load(open(os.path.join(halved, "checkpoints", "step-00000010", "metadata.json")))
    counted = tokens.get(10) == 5 * batch + 5 * batch // 2 == final["client_state"]["tokens_seen"]
    print(f"{'ok  ' if counted else 'FAIL'} tokens after a resume at half the batch: {tokens.get(10)} at step 10 "
          f"(saved {final['client_state']['tokens_seen']}; {batch} a step before it)")
    ok &= counted

    # Another seq_len would make the saved window index name other tokens: refused.
    proc = train(os.path.join(WORK, "refused"), 0, [f'checkpoint.resume="{saved}"', "data.seq_len=16"], expect_rc=2)
    errors = [l for l in proc.stderr.splitlines() if l.startswith("fsdpp: error:")]
    refused = len(errors) == 1 and "seq_len" in errors[0] and "step-00000005" in errors[0]
    print(f"{'ok  ' if refused else 'FAIL'} another seq_len is refused: {errors}")
    ok &= refused
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
